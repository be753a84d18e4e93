#!/bin/bash
cd /app
awk '{ total += $1 } END { print total }' data.txt > sum.txt
