import csv, sys, collections
for path in sys.argv[1:]:
    rows = []
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get('Metric Name') == 'gpu__time_duration.sum':
            v = float(r['Metric Value'].replace(',', ''))
            unit = r.get('Metric Unit', 'nsecond')
            us = v / 1000 if unit.startswith('n') else (v if unit.startswith('u') else v * 1000)
            rows.append((r['Kernel Name'].split('(')[0], us))
    agg = collections.OrderedDict()
    for n, us in rows:
        c, t = agg.get(n, (0, 0.0)); agg[n] = (c + 1, t + us)
    tot = sum(us for _, us in rows)
    print(f"{path}: {len(rows)} kernels, {tot:.1f} us in kernels")
    for n, (c, t) in agg.items():
        print(f"  {n:28s} x{c:4d} {t:9.1f} us  ({t / c:7.2f} us each)")
