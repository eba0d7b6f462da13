"""The kill marks (`proc.str_kill`): what a run's frame becomes when a kill the scheduler asked
for has ended it. Their own module, with no imports, because both the kill side
(dispatch.engine.kills, which marks and sends) and the completion side (dispatch.engine.completion,
which reads the mark from the proc it deletes) name them, and the completion must not import the
sender. None of them is ever taken for a memory failure, whatever the run's exit says, except
KILL_MEMORY, which is one by design (another component's low-memory kill writes it).
"""

KILL_JOB = "JOB"  # the frame is eaten when its run ends (the job is finished)
KILL_FRAME = "FRAME"  # the frame goes back to WAITING when its run ends (runs again elsewhere)
# The scheduler's own kills for a frame's life (dispatch.engine.completion reads them from the
# deleted proc): none of them is ever taken for a memory failure, whatever the run's exit says,
# except KILL_MEMORY, which is one by design.
KILL_TIMEOUT = "TIMEOUT"  # ran past the layer's timeout: DEAD (auto-eat: EATEN), not retried
KILL_LLU = "LLU"  # its log was silent past the layer's timeout_llu: DEAD (auto-eat: EATEN), not retried
KILL_NIMBY = "NIMBY"  # its host was NIMBY-locked: back to WAITING, no retry charged
KILL_MEMORY = "MEMORY"  # killed for memory (the host ran low): a memory failure, retried with more memory
KILL_REASONS = (KILL_JOB, KILL_FRAME, KILL_TIMEOUT, KILL_LLU, KILL_NIMBY, KILL_MEMORY)
