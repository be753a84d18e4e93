#!/bin/bash
mkdir -p /logs/verifier
expected=$(python3 -c "print(sum(int(line) for line in open('/app/data.txt') if line.strip()))")
if [ -f /app/sum.txt ] && [ "$(tr -d '[:space:]' < /app/sum.txt)" = "$expected" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
