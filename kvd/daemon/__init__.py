"""The daemon (`kvd serve`, `python -m kvd serve`): its parts assembled, started in order, drained and
stopped in reverse.

- lifecycle.py: `Daemon` (the start and stop order, signals, the drain, the lease sweeper) and
  `serve`, the command's entry point;
- planes.py: the host arena and its slot sizes, the device and disk planes, the engine over them;
- serving.py: the gRPC server and its services, the listeners, the arena socket, endpoints.json;
- prometheus.py: the collectors over the planes and the metrics endpoint;
- systemd.py: sd_notify and the watchdog's keep-alives;
- logs.py: log lines as text or JSON.

Every module logs as "kvd.daemon".
"""
