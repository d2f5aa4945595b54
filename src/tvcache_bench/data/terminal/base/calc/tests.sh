#!/bin/sh
# Checks ./calc against expected answers; prints one line per case and a summary.
fail=0
check() {
    expected="$1"; shift
    got=$(./calc "$@" 2>&1)
    if [ "$got" = "$expected" ]; then echo "ok    $*"; else echo "FAIL  $*: expected '$expected', got '$got'"; fail=$((fail + 1)); fi
}
[ -x ./calc ] || { echo "no ./calc: run make first"; exit 2; }
check 5 2 + 3
check 4 7 - 3
check 12 3 x 4
check 2 6 / 3
check 1 7 % 3
check "error: division by zero" 1 / 0
check "error: division by zero" 1 % 0
check "error: unknown operator ^" 2 ^ 3
if [ $fail -eq 0 ]; then echo "all 8 passed"; else echo "$fail of 8 failed"; exit 1; fi
