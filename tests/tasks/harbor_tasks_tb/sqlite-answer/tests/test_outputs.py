import sqlite3
from pathlib import Path

QUERY = """
SELECT p.category, ROUND(SUM(s.quantity * p.price), 2) AS revenue
FROM sales s JOIN products p ON p.id = s.product_id
WHERE s.day LIKE '2026-11-%'
GROUP BY p.category ORDER BY revenue DESC LIMIT 1
"""


def test_answer_file_exists():
    assert Path("/app/answer.txt").is_file()


def test_answer_names_the_top_category_and_its_revenue():
    category, revenue = sqlite3.connect("file:/app/shop.db?mode=ro", uri=True).execute(QUERY).fetchone()
    assert Path("/app/answer.txt").read_text().split() == [category, f"{revenue:.2f}"]
