"""`tiered-kv quality` lives in tiered_kv/tools/quality.py (it measures a model through a CacheBank:
a tool, not part of the codecs). These names stay importable from here for code written before."""

from ..tools.quality import (DEFAULT_CHUNK_TOKENS, DEFAULT_CONTINUATION_TOKENS, DEFAULT_TOKENS,  # noqa: F401
                             HOT_SPARE_BLOCKS, QualityReport, default_text, format_report, measure)
