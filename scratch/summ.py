import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors='replace')))
print('first rows:', rows[:3])
hdr_i = next((i for i, r in enumerate(rows) if any('Sampl' in c for c in r)), None)
if hdr_i is None:
    sys.exit('no sampling column')
hdr = rows[hdr_i]
print('header:', hdr)
si = [i for i, c in enumerate(hdr) if 'Sampl' in c and 'All' in c][0]
ii = [i for i, c in enumerate(hdr) if 'Instructions Executed' in c]
out, cur = [], ''
for r in rows[hdr_i + 1:]:
    if len(r) <= si:
        if r:
            cur = r[-1][-40:]
        continue
    try:
        v = float(r[si] or 0)
    except ValueError:
        if r and 'File' in r[0]:
            cur = r[-1][-40:]
        continue
    out.append((v, float(r[ii[0]] or 0) if ii and r[ii[0]].replace('.', '').isdigit() else -1, cur, r[0][:6], r[1][:100]))
tot = sum(o[0] for o in out)
print('total samples', tot, 'rows', len(out))
for v, ins, f, ln, s in sorted(out, key=lambda t: -t[0])[:45]:
    print(f'{v:6.0f} {100 * v / max(tot, 1):5.1f}% inst {ins:8.0f} {f[-22:]}:{ln} {s}')
