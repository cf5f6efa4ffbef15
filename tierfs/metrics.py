"""Prometheus metrics of a live mount (--metrics-port).

A custom collector turns the daemon's Stats and live state into metric families
at scrape time, so the hot path only bumps plain counters. prometheus-client is
the standard Python client; its HTTP server runs in its own thread.
"""
from __future__ import annotations

import time

from prometheus_client import start_http_server
from prometheus_client.core import (REGISTRY, CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

_COUNTERS = {
    "hot_read_bytes": ("tierfs_read_bytes", "Bytes served to readers, by tier", {"tier": "hot"}),
    "miss_read_bytes": ("tierfs_read_bytes", "Bytes served to readers, by tier", {"tier": "cold"}),
    "cold_read_bytes": ("tierfs_cold_fetch_bytes", "Bytes fetched from the bucket", {}),
    "cold_reads": ("tierfs_cold_fetches", "Extents fetched from the bucket", {}),
    "write_bytes": ("tierfs_write_bytes", "Bytes written by applications", {}),
    "uploads": ("tierfs_uploads", "Extents uploaded", {}),
    "upload_bytes": ("tierfs_upload_bytes", "Bytes uploaded", {}),
    "upload_errors": ("tierfs_upload_errors", "Failed upload attempts", {}),
    "evictions": ("tierfs_evictions", "Extents evicted from the hot tier", {}),
    "checksum_errors": ("tierfs_checksum_failures", "Checksum mismatches", {"tier": "cold"}),
    "hot_checksum_errors": ("tierfs_checksum_failures", "Checksum mismatches", {"tier": "hot"}),
    "gc_deleted": ("tierfs_gc_deleted_objects", "Objects deleted by gc", {}),
    "checkpoints": ("tierfs_checkpoints", "Metadata checkpoints written", {}),
    "readahead_extents": ("tierfs_readahead_extents", "Extents fetched by readahead", {}),
    "backpressure_waits": ("tierfs_backpressure_waits", "Writer waits for hot tier room", {}),
    "direct_open_files": ("tierfs_direct_open_files", "Files opened by tierfs.open (direct reads)", {}),
    "direct_extents": ("tierfs_direct_extent_files", "Hot extent files handed to direct readers", {}),
    "direct_bytes": ("tierfs_direct_bytes", "Bytes of the extent files handed to direct readers", {}),
}


class DaemonCollector:
    def __init__(self, daemon):
        self.daemon = daemon

    def collect(self):
        d = self.daemon
        stats = d.stats
        counters = stats.snapshot()
        families: dict[str, CounterMetricFamily] = {}
        for key, (name, doc, labels) in _COUNTERS.items():
            fam = families.get(name)
            if fam is None:
                fam = families[name] = CounterMetricFamily(name, doc, labels=sorted(labels))
            fam.add_metric([labels[k] for k in sorted(labels)], counters.get(key, 0))
        yield from families.values()

        requests = CounterMetricFamily("tierfs_s3_requests", "Object store requests",
                                       labels=["op"])
        errors = CounterMetricFamily("tierfs_s3_errors", "Object store errors",
                                     labels=["op", "type"])
        not_found = CounterMetricFamily(
            "tierfs_s3_not_found", "Expected 'no such object' answers (not errors)",
            labels=["op"])
        changed = CounterMetricFamily(
            "tierfs_s3_changed", "Conditional writes that found the object changed (the "
            "writer lease: another node wrote it first)", labels=["op"])
        control = CounterMetricFamily("tierfs_control_requests", "Control socket requests "
                                      "(tierfs commands, tierfs.open, hints)", labels=["cmd"])
        for key, value in counters.items():
            if key.startswith("control_requests:"):
                control.add_metric([key.split(":", 1)[1]], value)
            elif key.startswith("s3_requests:"):
                requests.add_metric([key.split(":", 1)[1]], value)
            elif key.startswith("s3_not_found:"):
                not_found.add_metric([key.split(":", 1)[1]], value)
            elif key.startswith("s3_changed:"):
                changed.add_metric([key.split(":", 1)[1]], value)
            elif key.startswith("s3_errors:"):
                _, op, kind = key.split(":", 2)
                errors.add_metric([op, kind], value)
        yield requests
        yield errors
        yield not_found
        yield changed
        yield control

        index = d.engine.index
        hot_b, miss_b = counters.get("hot_read_bytes", 0), counters.get("miss_read_bytes", 0)
        gauges = [
            ("tierfs_hot_bytes", "Bytes on the hot tier", index.total),
            ("tierfs_dirty_bytes", "Bytes not uploaded yet (upload backlog)", index.dirty_bytes),
            ("tierfs_hot_limit_bytes", "Hot tier high watermark", d.space.high),
            ("tierfs_uploads_running", "Uploads under way (at most --upload-parallel)",
             d.uploader.limit.borrowed_tokens),
            ("tierfs_uploads_queued", "Extents handed to the uploader waiting for a slot",
             max(0, len(d.uploader.in_flight) - d.uploader.limit.borrowed_tokens)),
            ("tierfs_hit_ratio", "Share of bytes read served from the hot tier",
             hot_b / (hot_b + miss_b) if hot_b + miss_b else 0.0),
        ]
        oldest = min((i.last_write for i in list(index.dirty.values())), default=None)
        gauges.append(("tierfs_upload_backlog_age_seconds", "Age of the oldest dirty extent",
                       time.monotonic() - oldest if oldest else 0.0))
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)

        hist_docs = {"fuse_op_seconds": ("tierfs_fuse_op_seconds", "FUSE request latency", "op"),
                     "cold_fetch_seconds": ("tierfs_cold_fetch_seconds", "Cold fetch latency", None),
                     "upload_seconds": ("tierfs_upload_seconds", "Upload latency", None),
                     "fetched_install_seconds": (
                         "tierfs_fetched_install_seconds",
                         "Runs of extents fetched along: waiting for an install thread, writing, "
                         "installing on the event loop",
                         "phase")}
        fams = {}
        for (name, label), h in list(stats.histograms.items()):
            metric, doc, label_name = hist_docs.get(name, (f"tierfs_{name}", name, "label"))
            fam = fams.get(metric)
            if fam is None:
                fam = fams[metric] = HistogramMetricFamily(
                    metric, doc, labels=[label_name] if label_name else [])
            buckets = [(str(b) if b != float("inf") else "+Inf", n) for b, n in h.cumulative()]
            fam.add_metric([label] if label_name else [], buckets, h.sum)
        yield from fams.values()


def serve(daemon, port: int, addr: str = "127.0.0.1") -> None:
    REGISTRY.register(DaemonCollector(daemon))
    start_http_server(port, addr=addr)
