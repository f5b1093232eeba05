# shellcheck shell=bash
# Reading a SoftRoCE VM run's output on the host: the helpers the run-*.sh
# scripts' summaries share. Source it, then set `out` to the file holding
# the VM's output (`record` reads it).

# field NAME LINE: the value of NAME=... in a PERFTEST or PERFBW line.
field() { printf '%s\n' "$2" | tr ' ' '\n' | sed -n "s/^$1=//p"; }

# json KEY RECORD: the first number (or string) after "KEY": in a record.
json() { printf '%s\n' "$2" | grep -o "\"$1\":[^,}]*" | head -n 1 | sed 's/^[^:]*://; s/"//g'; }

# records RUN: the JSON records of that bench run, one per line (the run's
# `BENCHJSON RUN [...]` line in "$out").
records() { sed -n "s/^BENCHJSON $1 //p" "${out:?}" | sed 's/},{"transport"/}\n{"transport"/g'; }

# record RUN OP: ours' record of that run and op (not the bare loop's).
record() { records "$1" | grep -v '"transport":"bare-verbs"' | grep "\"op\":\"$2\"" | head -n 1; }

# bare_record RUN OP: the bare verbs loop's record of a --verbs-baseline run.
bare_record() { records "$1" | grep '"transport":"bare-verbs"' | grep "\"op\":\"$2\"" | head -n 1; }

fmt1() { awk -v v="$1" 'BEGIN { printf "%.1f", v }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }

# median / minimum / maximum: of the numbers on stdin (space or newline
# separated; "n/a" and other words are not numbers and are skipped).
numbers() { tr ' ' '\n' | grep -E '^-?[0-9.]+(e[-+]?[0-9]+)?$' || true; }
# An even count's median is the mean of the middle two, printed with their
# decimals (one more when it needs it): 1.00 and 1.00 give 1.00, not 1.
median() {
    numbers | LC_ALL=C sort -g | awk '
        { v[NR] = $1 }
        END {
            if (!NR) exit
            if (NR % 2) { print v[(NR + 1) / 2]; exit }
            a = v[NR / 2]; b = v[NR / 2 + 1]; m = (a + b) / 2
            d = (i = index(a, ".")) ? length(a) - i : 0
            s = sprintf("%.*f", d, m)
            if (s + 0 != m) s = sprintf("%.*f", d + 1, m)
            print s
        }'
}
minimum() { numbers | LC_ALL=C sort -g | head -n 1; }
maximum() { numbers | LC_ALL=C sort -g | tail -n 1; }
