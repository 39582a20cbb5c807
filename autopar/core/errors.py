"""The exceptions and warnings autopar raises; every message says what is wrong and what to do."""


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class CaptureError(AutoparError):
    """The model could not be traced into an ATen graph."""

    def __init__(self, message: str, *, reason: str = "", hint: str = ""):
        self.reason = reason
        self.hint = hint
        text = message
        if reason:
            text += f"\n  tracer said: {reason}"
        if hint:
            text += f"\n  hint: {hint}"
        super().__init__(text)


class ClusterError(AutoparError, ValueError):
    """A cluster description is invalid (sizes, mesh, device, preset)."""


class ShardingError(AutoparError, ValueError):
    """A placement or sharding is malformed or does not fit the tensor or mesh."""


class InfeasibleError(AutoparError):
    """No plan meets the memory limit; `smallest_peak` is the lowest peak (bytes) any plan reached."""

    def __init__(self, message: str, *, smallest_peak: float | None = None):
        self.smallest_peak = smallest_peak
        super().__init__(message)


class InputError(AutoparError, ValueError):
    """The model, example_inputs, loss_fn or target are of the wrong kind or inconsistent."""


class UnsupportedOpWarning(UserWarning):
    """An op has no sharding rule; it is planned all-replicated (correct, maybe slow)."""


class PlanError(AutoparError, ValueError):
    """A plan is malformed, from another schema version, or does not fit the model or cluster."""


class ZooError(AutoparError, ValueError):
    """A model factory in autopar.zoo got sizes that make no valid model."""


class SolverInputError(AutoparError, ValueError):
    """A solver was given a malformed problem (shapes, indices, negative or non-finite costs)."""


class SolverTimeoutError(AutoparError):
    """A solver found no plan within its time limit, or stopped without a usable answer."""


class CodegenError(AutoparError, ValueError):
    """A sharding assignment cannot be turned into a distributed program (missing or mismatched
    strategies, a loss that is not replicated, a graph feature the code generator lacks)."""


class CheckpointError(AutoparError, ValueError):
    """A checkpoint is missing, corrupt, from another format version, or from another model or
    optimizer than the one it is loaded into."""


class UnsupportedDtypeError(CaptureError):
    """The model computes in a dtype autopar cannot plan or run (complex, float8, quantized)."""


class SolverTimeLimitWarning(UserWarning):
    """The solver stopped at its time limit: the plan is the best found, within ``gap`` of optimal."""


class PipelineError(AutoparError, ValueError):
    """A pipelined plan cannot be run as asked (stage meshes, loss, micro-batches)."""
