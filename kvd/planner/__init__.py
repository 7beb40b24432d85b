"""Per-request KV placement between a GPU and host memory for decode steps (issue 16).

After OrbitFlow (DESIGN.md): a request at offload distance d keeps every (d+1)-th layer of its KV on
the host and fetches it d layers ahead; the planner picks a distance per request so that the step's
latency, under a model of layer-wise prefetch over one shared host-to-GPU link, is smallest within
the GPU's block budget. Pure: numpy, the standard library and the native search, no I/O, no clocks.

- `distance`: the pruned distance options and what each offloads;
- `latency`: the step-latency model;
- `search`: exhaustive search (the oracle) and branch and bound over the pruned space (native);
- `plan`: the plan around the search: SLO with deposits, the decode window, pause;
- `profile`: per-layer compute and bandwidth, corrected by the engine's step reports;
- `slack` and `io_schedule`: the disk's side of the same question, which job a drive runs next
  (restores before prefetches before write-back, writes in the gaps Tutti's slack table finds);
  the daemon's I/O executor (kvd.planes.io_executor) and the simulator drive it alike.
"""
