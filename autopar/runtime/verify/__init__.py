"""``verify``: a plan's emitted programs run for one training step on fake tensors, measured
against what the plan predicts (peak memory by kind, collectives, FLOPs).

    report = autopar.verify.verify(plan, captured, model)   # or compiled.verify()
    print(report)                                           # report.to_json(), report.ok
"""

from autopar.runtime.verify.fake import VerifyError
from autopar.runtime.verify.report import Verification
from autopar.runtime.verify.run import verify

__all__ = ["Verification", "VerifyError", "verify"]
