#!/bin/bash
cd /app
python3 - <<'PY'
import sqlite3

row = sqlite3.connect("shop.db").execute(
    "SELECT p.category, SUM(s.quantity * p.price) AS revenue FROM sales s JOIN products p ON p.id = s.product_id "
    "WHERE s.day BETWEEN '2026-11-01' AND '2026-11-30' GROUP BY p.category ORDER BY revenue DESC LIMIT 1").fetchone()
open("answer.txt", "w").write(f"{row[0]} {row[1]:.2f}\n")
PY
