"""What this process is doing, in a line, for the report of a dead or frozen peer (heartbeat.py): which optimizer step
it is in, the long spans it is inside (a checkpoint save or load, a compile: `timeouts.long_running`), and what its
main thread runs now, read from the thread's Python stack, e.g.

    step 4, checkpoint save; main thread: training > save > callback on_save, at job.py:41 in on_save

The stack is read only when a line is asked for (every heartbeat), so nothing is added to the steps themselves: no
module hooks, no markers in the loops. A function named in `_CALLS` anywhere on the stack names a phase (the Trainer's,
a custom loop's `from_pretrained`, `backward`, a module's forward), outermost first.
"""

from __future__ import annotations

import os
import sys
import threading

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

# function name -> the phase it names, wherever it is defined (the Trainer's, torch's, this package's)
_CALLS = {
    "from_pretrained": "load",
    "parallelize": "parallelize",
    "_inner_training_loop": "training",
    "evaluate": "evaluation",
    "predict": "prediction",
    "_save_checkpoint": "save",
    "save_model": "save",
    "save_model_checkpoint": "save",
    "load_model_checkpoint": "checkpoint load",
    "_call_impl": "forward",
    "backward": "backward",
    "_use_grad": "optimizer step",  # torch.optim's wrapper of every step()
}
_OWN_FILES = {__file__, os.path.join(os.path.dirname(__file__), "heartbeat.py")}
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))  # torch's own frames: the line names who called into them
_LINE_MAX = 400  # the line travels in the rendezvous store with every beat


class _State:
    def __init__(self) -> None:
        self.steps = 0
        self.spans: list[str] = []
        self.lock = threading.Lock()
        self.hook = None


_STATE = _State()


def count_steps() -> None:
    """Count optimizer steps from now on (torch.optim's global post-hook: any loop); once per process."""
    with _STATE.lock:
        if _STATE.hook is None:
            _STATE.hook = register_optimizer_step_post_hook(_stepped)


def _stepped(optimizer, args, kwargs) -> None:
    _STATE.steps += 1


def enter(span: str) -> None:
    """This process is inside `span` (a checkpoint save, a compile) until `leave(span)`."""
    with _STATE.lock:
        _STATE.spans.append(span)


def leave(span: str) -> None:
    with _STATE.lock:
        innermost = [i for i, name in enumerate(_STATE.spans) if name == span]
        if innermost:
            del _STATE.spans[innermost[-1]]


def describe() -> str:
    """One line: the step (the number of optimizer steps ended + 1), the open spans, the main thread's phases and the
    line it runs."""
    with _STATE.lock:
        steps, spans = _STATE.steps, list(_STATE.spans)
    parts = [f"step {steps + 1}" if steps else "before the first optimizer step", *dict.fromkeys(spans)]
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is not None:
        parts.append(f"main thread: {_stack_line(frame)}")
    return ", ".join(parts)[:_LINE_MAX]


def _stack_line(frame) -> str:
    """The named phases of the stack, outermost first (repeats dropped), its innermost frame and, when that is
    torch's, the frame that called into torch: "training > forward, at distributed_c10d.py:3252 in all_reduce, from
    layers.py:80 in forward"."""
    while frame.f_back is not None and frame.f_code.co_filename in _OWN_FILES:  # a beat written by the main thread
        frame = frame.f_back
    where, caller = f"at {_frame_line(frame)}", None
    phases: list[str] = []
    while frame is not None:
        if caller is None and _TORCH not in frame.f_code.co_filename:  # who called into torch (a collective, ...)
            caller = frame
            if where != f"at {_frame_line(caller)}":
                where += f", from {_frame_line(caller)}"
        name = frame.f_code.co_name
        phase = _CALLS.get(name)
        if name == "call_event":  # transformers' CallbackHandler: the event is its argument
            event = frame.f_locals.get("event")
            phase = f"callback {event}" if isinstance(event, str) else None
        if phase and (not phases or phases[-1] != phase):
            phases.append(phase)
        frame = frame.f_back
    phases.reverse()
    return f"{' > '.join(phases)}, {where}" if phases else where


def _frame_line(frame) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
