"""What operators see: the metric catalogue, telemetry that every process records into Redis,
per-cache hit counters, and the dashboard snapshot the admin, `/metrics` and `routing_stats` show.

Imported by anyone for `telemetry` and `metric_catalog`. `dashboard` reads `kv` and `fleet`, so
it is the top of the routing layers; nothing below imports it.
"""
