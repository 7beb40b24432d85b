"""A deterministic simulator that drives the real engine (`python -m kvd.sim`).

- config.py: one run's configuration (tiers, policies, clients' habits, faults);
- traces.py: synthetic serving traffic (chat sessions, shared system
  prompts, Zipf-popular RAG documents, bursty arrivals, tenants);
- disk.py: a modelled NVMe drive in simulated time;
- plane.py: fake bytes in host and disk slots, to check what is served;
- events.py: simulated time and its event queue;
- world.py: the engine, its namespaces and the daemon's mover, built for a run;
- clients.py: each request through the engine (Get, Put, Delete, prefetch);
- drives.py: the mover's write rounds, journals and reads on the modelled devices;
- durable.py: Puts acknowledged only once durable;
- faults.py: writes that fail and reads that come back corrupt;
- invariants.py: what must hold after every step;
- results.py: what a run measured;
- simulator.py: one seeded run, composing the parts above;
- report.py: policies x host capacities, as a table, a plot and JSON;
- decode.py: the placement planner in decode (`python -m kvd.sim.decode`).

It sits beside kvd.testing: it may import the core and the leaves, and
nothing in the daemon imports it.
"""
