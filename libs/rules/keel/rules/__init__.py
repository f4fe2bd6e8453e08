"""keel.rules: pure rules that more than one service uses.

``metrics``: metric anomalies (NaN/Inf, spikes, throughput decline); ``stacks``: stack-dump parsing and
fingerprints; ``sdc``: silent-data-corruption group-test planning; ``sdc_replay``: replay units and the
judging of a replay round; ``ettr``: the effective-training-time ratio from recorded events.
"""
