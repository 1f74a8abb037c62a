"""`specdec bench`: the measuring instrument for speed (issue 10). See bench/README.md.

workloads and presets (what runs) → inprocess / gateway_path (its clients: gateway_clients) / peer (the paths)
→ latency, traffic, roofline (the figures) → checks (their identities) → report (JSON, table, PNG); bench_run ties
them together.
"""
