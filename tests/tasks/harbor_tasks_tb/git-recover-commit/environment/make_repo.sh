#!/bin/bash
# A repository whose last commit was thrown away with a hard reset: it survives in the reflog.
set -euo pipefail
mkdir -p /app/repo && cd /app/repo
git init -q -b main
git config user.name "Dev" && git config user.email "dev@example.invalid"
echo "# Notes" > README.md && git add README.md && git commit -qm "start notes"
printf 'deploy key rotation: every 90 days\nowner: platform team\n' > policy.txt
git add policy.txt && git commit -qm "add the rotation policy"
git reset -q --hard HEAD~1
