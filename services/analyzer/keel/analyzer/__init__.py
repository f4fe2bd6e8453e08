"""The analyzer: stack aggregation, fail-slow rounds, metric anomalies and SDC localisation (rungs 3 and 5)."""
