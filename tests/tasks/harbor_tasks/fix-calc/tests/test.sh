#!/bin/bash
# Runs the tests without pytest (the base image has none) and reports per-test results in
# reward.json, as Harbor's multi-metric verifiers do.
mkdir -p /logs/verifier
cd /tests
python3 - <<'PY'
import json
import calc_checks as test_calc

results = {}
for name in ("test_add", "test_mul_unchanged"):
    try:
        getattr(test_calc, name)()
        results[name] = 1
    except Exception:
        results[name] = 0
reward = 1.0 if all(results.values()) else 0.0
with open("/logs/verifier/reward.json", "w") as handle:
    json.dump({"reward": reward, **results}, handle)
PY
