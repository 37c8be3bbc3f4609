"""Configuration: one frozen ``Settings`` from flags, environment and pod labels.

    settings.py   the fields, each checked on its own
    loader.py     flags > env ``DISAGG_*`` > pod labels/annotations > defaults, with sources
    podinfo.py    the pod's labels and annotations (downward-API files)
    docs.py       the configuration reference (docs/operating/configuration.md), generated
"""
