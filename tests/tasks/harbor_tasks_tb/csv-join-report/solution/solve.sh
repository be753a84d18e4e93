#!/bin/bash
cd /app
python3 - <<'PY'
import csv
from collections import defaultdict

names = {row["user_id"]: row["name"] for row in csv.DictReader(open("data/users.csv"))}
count, total = defaultdict(int), defaultdict(float)
for row in csv.DictReader(open("data/orders.csv")):
    count[row["user_id"]] += 1
    total[row["user_id"]] += float(row["amount"])
with open("report.csv", "w", newline="") as handle:
    out = csv.writer(handle, lineterminator="\n")
    out.writerow(["name", "orders", "total"])
    for user in sorted(total, key=total.get, reverse=True):
        out.writerow([names[user], count[user], f"{total[user]:.2f}"])
PY
