#!/bin/bash
cd /app
python3 - <<'PY'
import json
from collections import Counter

codes = Counter(line.split('"')[2].split()[0] for line in open("access.log") if line.strip())
json.dump({**codes, "total": sum(codes.values())}, open("summary.json", "w"), indent=2)
PY
