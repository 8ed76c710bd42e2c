"""What the fork server behind `tests.harness.run_ranks` imports once for every rank it starts.

torch, plait and the Hugging Face model classes the tests build; a rank then imports only its
test's module. Optional packages missing here are imported (and reported) by the test itself.
"""

from __future__ import annotations

import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.export  # noqa: F401

import plait  # noqa: F401
import plait.model  # noqa: F401
import tests.harness  # noqa: F401
from tests.architectures import MODEL_CLASSES

try:
    import transformers
except ImportError:  # pragma: no cover - the dev extra has it
    transformers = None
if transformers is not None:  # it imports each model family on first use: the ones the tests build
    for name in (*MODEL_CLASSES, "BertForSequenceClassification"):  # the last: tests/test_real_models.py
        getattr(transformers, name, None)
