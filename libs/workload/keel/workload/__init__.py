"""keel.workload: a real example training workload (GPT-style LM, generated data, DP x PP on gloo).

``model``: the model and its pipeline split; ``data``: the generated dataset and resumable sampler;
``train``: the distributed training entry point (``python -m keel.workload.train``) and ``topology``.
"""
