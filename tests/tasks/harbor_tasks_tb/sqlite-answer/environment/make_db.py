"""A small shop database: products and sales."""
import random
import sqlite3
import sys

random.seed(11)
db = sqlite3.connect(sys.argv[1])
db.execute("CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, category TEXT, price REAL)")
db.execute("CREATE TABLE sales (id INTEGER PRIMARY KEY, product_id INTEGER, quantity INTEGER, day TEXT)")
categories = ["books", "garden", "kitchen", "toys"]
for pid in range(1, 41):
    db.execute("INSERT INTO products VALUES (?, ?, ?, ?)",
               (pid, f"product-{pid}", categories[pid % 4], round(random.uniform(2, 80), 2)))
for sid in range(1, 401):
    db.execute("INSERT INTO sales VALUES (?, ?, ?, ?)",
               (sid, random.randint(1, 40), random.randint(1, 5), f"2026-11-{random.randint(1, 25):02d}"))
db.commit()
