"""A deterministic simulator that drives the real engine (`python -m kvd.sim`).

- traces.py: synthetic serving traffic (chat sessions, shared system
  prompts, Zipf-popular RAG documents, bursty arrivals, tenants);
- disk.py: a modelled NVMe drive in simulated time;
- plane.py: fake bytes in host and disk slots, to check what is served;
- simulator.py: one seeded run, invariants after every step;
- report.py: policies x host capacities, as a table, a plot and JSON.

It sits beside kvd.testing: it may import the core and the leaves, and
nothing in the daemon imports it.
"""
