"""Step plans: serve a repeating training or inference step from one arena planned offline (issue 18).

A program that repeats one step (a training loop) marks its step boundaries
(:meth:`~gpumem.allocator.caching.CachingAllocator.mark_step`, :func:`gpumem.torch.step`). The allocator
records the steps' allocations; once two recorded steps allocate the same sizes on the same streams, the
first of them is planned (:func:`plan_step`: every allocation freed within a step, or early in the next
one, gets an offset in one arena, greedy-best) and the plan is installed in the engine, which serves the
``k``-th allocation of every later step at ``arena + offset[k]`` when it fits (Note [Step plans]).

This module holds the planner (numpy) and :class:`StepPlan`, the plan layer of the Python reference engine
(:class:`~.python_engine.PythonEngine`); the native engine's (``gpumem/_native/engine.cpp``, ``Engine::plan_*``)
is its port and makes the same decisions (``tests/allocator/test_native_differential.py``).

Note [Step plans]
-----------------
Why: live GPT-2 training held 5.56 % above peak allocated on gpumem's online engine; the simulated
study (``reports/sim-step-plan.md``) held 0.23-0.55 % in the steady steps of repeating traces with no
driver call per step by planning a step offline. How: a plan layer in front of the engine (both engines),
off until the program marks a step. ``mark_step`` 1 starts recording (per allocation: size, stream, and
the allocation rank of its free, in its own step or in the next); 2 closes that step and records the
next (whose frees finish the first step's lifetimes: gradients made in backward and freed at the next
``zero_grad`` wrap round the boundary); 3 compares the two steps: the same (size, stream) sequence
makes the first the template (READY), else the window slides. The planner gives each item (allocation
freed in its step, or in the next before its own slot comes round again) an offset; others (weights,
optimizer state, anything longer-lived) stay the engine's. Streams are planned apart (stacked), so no
slot is reused across streams without an event; the engine still refuses a slot whose address range
meets another stream's. Serving: the ``k``-th allocation of a step takes slot ``k`` when its size is
at most the slot's, its stream the slot's, and no live arena allocation overlaps the slot (a list of
the live slots' address ranges, kept sorted: a search, no driver call). A mismatch sends the rest of the
step to the engine; the last :data:`MISS_LIMIT` (3) planned steps missed, or :data:`MISS_WINDOW_LIMIT`
(4) of the last :data:`MISS_WINDOW` (8), drop the plan (its arena goes back once its last allocation is
freed) and recording starts again. Why a window: a missed step holds a step's worth twice (the arena
and the engine's cache); counted only in a row, steps that alternate hit and miss kept the plan for good
(46 MiB against 22 MiB unmarked in the review's loop), and such steps are never planned again (no two in
a row match). Why half: a plan whose steps repeat with a miss between hits (one step in three differs)
is planned again right after a drop, with the same peak and a re-plan and re-map every nine steps (seen
with a limit of 3 of 8); at half, the plan serves no more steps than it misses.
The arena is an address reservation of its own whose pages are mapped when a slot first touches them,
after the engine gave back its idle cache: the previous step's leftovers (the gradients above) still
sit in the engine during the first planned step, and an arena mapped whole at install would hold their
pages twice (475 MiB, 4.5 % of GPT-2 fp32's step, in the study's trace). Its pages count in reserved;
freeing it waits for its streams (``stream_synchronize``), once per dropped plan.

Note [A plan laid out for its first step]
-----------------------------------------
Why: on four of the five corpus traces whose plan forms, the run's peak was the first planned step (ResNet-50
0.80 % there, 0.34 % in every step after it). The items that wrap into the next step (gradients freed at the next
``zero_grad``) were allocated by the engine in the last recorded step and stay there, live, until their frees early
in the first planned step; their slots in the arena are empty until then, while the pages around them are mapped
as their neighbours first touch them: a page shared with an empty slot holds no live byte of it (ResNet-50: 161
such items, 0.10 GB in all; 23.8 MB of its arena's pages held no live byte at that step's peak). How: :attr:`Planner.GREEDY_BEST` also tries each of its three orders with
the wrapping items placed first (they are all alive at the step's start, so they need their sum anyway and end up
side by side at the bottom), and, given the arena's page size (``page_nbytes``: the device's granularity; both
``CachingAllocator.mark_step`` and ``gpumem.torch`` pass it), keeps the layout whose :func:`first_step_nbytes` is
least: the most pages mapped in the first step plus the leftovers still live in the engine, or every page a slot
touches (the steps after), whichever is more; ties by height. Without a page size, or where none or all of the
items wrap (the extra orders are then the three first ones), it keeps the lowest, as before. The choice is the
model's: the engine's own cache is not in it, and of 500 random workloads of a review, the engine held more under
the chosen layout than under the lowest in 1 and less in 12.
Corpus, ``sim:h200-141gb``, default timing: resnet50_train 0.80 -> 0.45 % (tuning), vit_train 1.01 -> 0.90 %
(check), no row higher (``reports/plan-first-step-2026-12-05.md``). The price: the mark that plans places six
orders instead of three (GPT-2 bf16's 1,587 allocations: 0.12 -> 0.25 s, once per plan).

Note [A plan taller than the device]
------------------------------------
Each stream's items are planned apart and stacked (Note [Step plans]); two streams that each use most of the
device stack past it, and a layout chosen for its first step may be taller than the lowest. The engines refuse
an offset past the device (``install_plan``), which a mark raised in a program doing nothing wrong (a review:
9 GiB a step on each of two streams of a 16 GB card, the third mark). ``plan_step`` takes the room a plan
has (``limit_nbytes``; :func:`plan_room_nbytes`: the device's memory, at most its free bytes plus the idle
chunks the engine can give back, and within the allocator's limit: Note [The room counts whole chunks]): where
the stack ends past it, every stream takes its lowest layout, and where that too ends past it, nothing is
planned (all -1, logged), and the engine serves the step as where no plan forms (a memory-first warm-up runs
to its end: Note [A memory-first warm-up]). All or
nothing: a plan of one stream beside another left to the engine held both, was dropped by the memory pressure
it made and formed again at the next match, forever (a review: 20 installed, 20 dropped, no planned step,
twice the device calls). A refused step is remembered (:class:`RefusedPlans`): the same step is not planned
again until the room grows (a review: 16 s of planning in a run of 0.2 s).

Note [The room counts whole chunks]
-----------------------------------
The arena gets its pages from the device after the engine gives its cache back, and the engine gives back
only chunks no live block touches: a chunk moves whole (Note [Chunks of several pages] in
:mod:`.backing`), so one live page keeps every page of it. The room first counted the engine's reserved
bytes less its live ones, holes between live blocks included; where the cache was such holes (a review: a
16 GB card, 2,700 holes of 3 MiB between 2 MiB blocks), the plan was installed, its arena ran out, the
engine's out-of-memory ladder dropped it and the allocation raised in a program that runs unmarked (10
errors in 30 steps, 10 plans dropped). Both engines count what their release would give back
(``releasable_nbytes``: whole idle chunks, cached chunks, free segments, blocks freed while other streams
use them) were the step's carried allocations that go before the next step allocates freed too (live at the
mark, placed by the plan: :meth:`StepTemplate.carried_nbytes`), and the room is the free bytes plus that:
counted whole, the carried bytes between blocks that stay made the same errors (a review: 204 in 30 steps),
and gradients freed after the forward pass (``zero_grad`` there) are still live while the arena maps it (a
review: 32 of 2,028 random training loops under a limit raised out of memory marked, not unmarked). Under a limit, the limit less what the engine keeps after
its release. And the plan needs its height plus what the engine serves beside the arena in the step
(:func:`engine_rise_nbytes`: allocations not freed within two steps share no memory with the arena): a plan
that fitted without it was installed and dropped by the out-of-memory ladder at every match in a band of
limits (a review: 10 of each in 30 steps).

Note [Step plans under memory pressure]
---------------------------------------
A step that leaves the plan is served by the engine while the arena keeps its mapped pages, so both can
hold a step's worth of memory; a program that fits unmarked under a limit ran out of memory marked.
Rule: before the engine declares out of memory (its retry ladder), and only once giving its own cache back
(waiting for its work) did not make room, ``StepPlan.shrink`` drops the plan (state RECORDING) and gives back
every run (a mapping made at once) of a dropped arena that no live allocation touches, after waiting for the
arena's streams; a dropped arena with nothing live goes back whole. The engine then retries. (The plan was
dropped first until a review found a plan installed and dropped at every match under a limit, 5 of each in 30
steps, where the engine's idle cache alone made room.) The arena's mapped bytes count in the out-of-memory error's reserved.
A failed give-back (``mem_unmap``, ``mem_release``, ``address_free`` or a wait) raises from the call
that tried it (the mark of a drop, a free, ``close``) and leaves the layer recording: each run notes
when it is unmapped, so the next try (every ``mark_step`` retries dropped arenas with nothing live)
releases it without unmapping again, and ``close`` leaks nothing once the device answers.

Note [A plan that leaves early]
-------------------------------
Why: a plan forms from the first two marked steps that match, and a program whose marks change their meaning
early (a WGAN whose critic marked first: the marks handed to the generator after two critic gaps, Note
[Automatic step marks] in gpumem/torch.py) installed a plan of the critic's steps that the generator's step
left at once. Until three misses dropped it, each step was served by the engine beside the arena's mapped
pages: the run's peak, 77.8 % above peak allocated in the replay of the live WGAN's own trace (76.25 % live).
Rule: a planned step that first leaves its plan (a slot's size or stream differs, or it runs past the template
with no restart) within the plan's first :data:`EARLY_LEAVE_STEPS` planned steps drops the plan at once, as
``shrink`` does (Note [Step plans under memory pressure]): the idle runs go back before the engine serves the
request, and the layer records again. At most :data:`EARLY_DROPS` such drops in a row (a plan that lives
:data:`EARLY_LEAVE_STEPS` planned steps resets the count), so steps that vary early re-record a bounded number
of times and then keep the miss rules of Note [Step plans] (a plan those drop leaves the count where it was:
no early drop until a plan lives). Only a leave, not a miss: a step that meets a kept block or a failed
mapping still allocates the template's sequence. The step marked mid-way through an install (allocations
between the mark and the install) is left by design and drops nothing, and so does a request that can never fit
(over the device or the limit: refused at once, the plan kept). A give-back that fails there is kept for the next
mark (the request it came in is served all the same; a lost device still raises). The engines'
``set_early_leave_steps`` sets the bound (0: never); it is internal, for the tests of the miss rules. Live on the H200: the WGAN 6.27 %
(PyTorch's allocator 16.55 %); every other trace of the corpus and of the live records replays as before
(reports/early-leave.md).

Note [When marks stop]
----------------------
A program may stop marking (automatic marks off, a stray ``step()``, the marking optimizer idle, an eval or
CUDA-graph phase). Before: while recording, each allocation appended a record that only a mark cleared,
+30.9 MiB of host memory per million allocations (native; about 150 B each in the Python engine), without
bound (attacker 11, F1); with a plan installed, its arena stayed mapped with nothing in it for good, beside
the engine's cache of the same temporaries, and ``empty_cache`` did not give it back (F2). Rules:
- a recorded step holds at most :data:`RECORD_LIMIT` (2**14) records; the next allocation abandons the
  recording (both steps' records freed, ``recordings_abandoned``) and the layer goes OFF: the engine alone,
  no record kept; the next mark starts over. So records stay under 2 x 2**14 (1 MiB native). Why absolute:
  the first step has no history to be a multiple of. Why 2**14: the planner runs inside the mark and grows
  faster than quadratically (CPU seconds on a loaded 2-core machine: 0.32 at 5,000 allocations, 0.92 at
  10,000, 7.3 at 20,000, 44 at 40,000: attacker 12, F3), and a drop pays it again at the re-plan; the
  training steps measured live make 493-1,587 allocations.
- a planned step whose allocations pass :data:`OVERRUN_FACTOR` (4) times its template's (counted from its mark
  or its implicit restart: Note [An implicit step restart]; steps that repeat keep the plan) drops the plan as a
  miss does (its arena's runs with nothing live go back at once, the rest at their last free) and goes OFF.
  Such a step left the plan at its template's end, so the plan serves none of it and would count it missed;
  four templates bound the time an idle arena is held to a few steps' worth of allocations. A long eval pass
  between two marks drops the plan; it is planned again three marks after training resumes.
- ``empty_cache`` also gives back every arena run no live allocation touches, the current plan's too (after
  the arena's streams), and keeps the plan: its slots map their pages again when they next serve, as the
  engine maps chunks again after its own ``empty_cache``. Dropping the plan there instead would re-plan
  every few steps a program that calls ``empty_cache`` each step.
What is left: a plan whose program stops marking and allocating (CUDA-graph replay) keeps its pages until
``empty_cache`` or memory pressure (the ladder's shrink). Each rule counts allocations, not time.

Note [An implicit step restart]
-------------------------------
Why: with automatic marks (one after each ``optimizer.step()``), a step that GradScaler skips (inf or NaN
gradients: no ``optimizer.step()``, no mark) made the next "step" two iterations long. Its second iteration
ran past the plan's last slot and was served by the engine beside the arena: peak reserved grew by a step's
temporaries (16 -> 24 MiB in ``tests/pytorch/test_torch_step_marks.py``'s loop) and the step counted as a
miss. AMP training skips several steps while its scale calibrates, so this is common; a program whose marks
stop while its steps go on repeating (Note [When marks stop]) lost its plan the same way.
Rule: when a planned step has used its last slot (the next allocation is its ``n``-th, ``n`` the slots) and
stayed on the template's sequence (not left: every allocation fit its slot's size and stream; the layer not
broken), an allocation that is slot 0's (its rounded size exactly, where a marked step's first allocation
may be smaller: with no mark, only the template's own first request is evidence of a new step; the slot's
stream; no live arena allocation over the slot) ends the step as a mark would (counted hit or
missed, ``_end_step``: the first step's cache give-back, a move off kept blocks) and starts a new one that
slot 0 serves; the next allocation takes slot 1. ``implicit_steps`` counts them. A restart that would drop
the plan (a miss making three in a row or four of eight) is not made: the step runs on past its slots and
the next mark counts and drops it, as before. The overrun bound counts from the restart (the cursor goes back
to 0), so a program whose marks stop but whose steps repeat keeps its plan, while one doing something else
runs past four templates and drops it. What it cannot do: a skipped iteration whose allocations differ from
the template's (a real optimizer allocates in ``step()``: the skipped iteration has fewer allocations, so the
next one's first allocation meets a later slot) leaves the plan there and is served by the engine as before
(GradScaler's skips are marked instead: Note [A step that ends early]);
so is an iteration whose allocation after the last slot is not slot 0's, or comes while a live allocation
of the step sits over slot 0. Why the exact size: with "at most the slot's", a marked step with one small
allocation too many at its end (a value logged every tenth step) restarted there and, that value kept past the
next step, held slot 0 twice until a move (peak 16 -> 20 MiB in the helper's loop).

Note [A step that ends early]
-----------------------------
A marked step that ends before its last slot, every allocation on its slot (``cursor < n``, not left, not
missed), counts as a hit. Why: such a step is the template's prefix; nothing in it went to the engine, so
the plan held what it plans and no driver call was made. The common case is GradScaler skipping
``optimizer.step()`` (inf or NaN gradients), which automatic marks now mark (Note [Automatic step marks] in
gpumem/torch.py): the skipped iteration ends where the optimizer's allocations would have come. Counted a
miss, an AMP loop skipping every other step (a scale that grows every step; live GPT-2 fp16 skips 16 of 40)
would miss four steps in eight and drop its plan every few steps (the test loop in
``tests/allocator/test_plan_implicit_restart.py``). Live, with both rules: 0.87 % above peak allocated, 37 of
37 planned steps hit; before them (no mark at a skip) 81.9 % (`reports/hil/gradscaler-skips-h200-2026-11-29.md`).
A step that is not its template's prefix (a slot's size or stream differs) still leaves the plan (``left``).

Note [A memory-first warm-up]
-----------------------------
Why: a plan serves the steps after it forms; the steps before it (setup, the first steps, which make the
optimizer state) are the engine's and decide the run's peak: 5.37 % above peak allocated in the replay of
live GPT-2 under the default policy (0.98 % in its planned steps), so live programs set the memory-first
policy by hand for the whole run (0.56 %), paying +7 to +50 % step time wherever no plan formed.
Rule (``AllocatorPolicy.plan_warmup``, on in the default policy; ``growth=CHUNKS`` with stealing): the first
``mark_step()``, or ``start_plan_warmup()`` (automatic marks call it when turned on: their first mark comes
after the first step), turns it on; while on, the engine grows as the memory-first setting does whatever its
knobs say: no page slack, the stream-ordered steal, chunks of one page up to 8 GiB held and 1/4096 of what is
held past it (:meth:`~.policy.AllocatorPolicy.memory_first`: every steal scanned the chunks, and one-page chunks made that
quadratic, 33 s for 200 multi-GB operations at 27 GB held, attacker 14; the steal now walks an index, Note [An
index of idle chunks] in :mod:`.backing`). It ends for good when a plan is
installed, at the :data:`WARMUP_MARKS` (8th) mark with none (a repeating loop is planned at its third), or
after :data:`WARMUP_ALLOCS` allocations with no mark (checked where the engine grows, the only place the
knobs are read). Either way the policy's knobs come back with the stream-ordered steal on (``steal_after_warmup``:
Note [The ordered steal after a warm-up] in :mod:`.backing`). Ended with a plan, what it grew stays. Ended with
none, the engine's idle cache goes back at
once (waiting for the GPU, as ``empty_cache``; ``warmup_give_back``, on by default): else its one-page chunks
outlive it and their pages are moved one by one in the steady steps. Live on the H200
(reports/hil/warmup-end-h200-2026-12-02.md), Llama with variable lengths: the give-back's step takes 250-370 ms
(about 6,300 chunks released, grown again in the next steps), once; kept, the steady steps (13-48, the warm-up's
end untimed) took a median +17 % over five rounds (more steals: 5,600-8,100 against 4,900-5,000 in 48 steps),
for 0.1-0.2 points less memory (5.73-5.89 % against 5.86-6.06 %); MoE 4.18 % kept against 4.07 %. A long run
pays the one step, a short one may prefer to keep (replayed, every trace in data/traces holds as much or less
kept: MoE 4.02 -> 2.44 %, GPT-2 5.54 -> 5.31 %). So the warm-up's cost is paid for a few steps; a program
that neither marks nor turns automatic marks on is not touched (with them on, a device no optimizer steps runs warm for its first
WARMUP_ALLOCS allocations). A policy that does not steal (``steal_empty_pages=False``) never begins it. Both engines count the same marks
and ``num_allocs`` (the differential test); ``PlanInfo.warmup`` says whether it is on.

Note [Step plans and record_stream]
-----------------------------------
A recorded step in which one of its allocations is used on another stream (``record_stream`` on the
engine's pointer, in its step or the next) is not planned: the mark that would make it READY slides the
window instead, and the engine serves the program as without marks. Why: such an allocation, once served
from a slot, keeps that slot taken after its free (no event orders its next occupant after the other
stream's work) until the plan is dropped; every later step misses there and the engine serves it beside
the arena, so both hold the bytes. Live on the H200 (multistream inference: two towers on two streams,
inputs copied on a third) that held 38.81 % above peak allocated against 5.43 % without a plan (3 slots
taken per plan, plans dropped after three misses and made again); a dropped arena's pages did go back at
its drop. The layer stays recording rather than giving up: recording costs a dict entry per allocation,
and a program whose cross-stream use stops (a warm-up) is planned once two clean steps match. A plan
installed before the use starts still poisons its slot and is dropped after :data:`MISS_LIMIT` misses.

Note [Step plans and threads]
-----------------------------
A mark that returns READY is followed by three calls: read the template, plan it (numpy, outside the
engine's lock), install. Another thread's mark in between moves the layer on (READY to RECORDING), and the
install then had no step to plan: ``mark_step`` raised in a program doing nothing wrong. Each READY gets a
generation (:attr:`StepPlan.generation`), read with its template (``step_template``, which answers None
when no step waits); ``install_plan(offsets, generation)`` of a step that went away or was replaced by a
newer READY installs nothing and returns False, and the mark returns READY as it found it. The plan is
never installed on another step than the one it was made for, and the next matching steps plan again.

Note [Allocations kept past their step]
---------------------------------------
A program may keep, now and then, an allocation its steps usually free (``losses.append(loss.detach())``
every tenth step). Served from the arena, it keeps its slot and the bytes under it taken. Counting the
steps whose slots meet it as misses dropped the plan three steps later and planned a new arena, while the
kept allocation pinned the old arena's run (pages are mapped in runs and go back only whole): reserved
memory grew by a run per kept allocation, without bound (attacker 9: a 512 B tensor kept every 10 steps
held 2,000 MiB after 200 steps against 102 MiB unmarked, and ran out of memory under a 600 MiB limit).
So a slot that meets a live allocation served two or more planned steps ago (past any lifetime the plan
gave it, which ends in the next step at the latest) is served by the engine and the step is not counted
as missed, whether or not it was used on another stream (attacker 10: a kept block also used on a side stream
pinned a page per re-plan); a slot taken by the step before, or left taken by a freed block that was used on
another stream (no event orders its next occupant), still counts. The plan stays, and the slots under the
kept bytes are served by the engine until they move off it (Note [Moving slots off kept blocks]).

Note [Moving slots off kept blocks]
-----------------------------------
Why: served by the engine while the arena kept its pages, a slot under a kept block was held twice for as
long as the block lived: with no limit, a 512 B block kept in a 4 GiB temporary's slot held 8,194 MiB for
good against 4,098 MiB unmarked (attacker 10; under a limit the ladder sheds it). Dropping the plan instead
was rejected: the dropped arena keeps the kept block's run, the next plan's next kept block drops it again,
a run per kept block without bound (attacker 9). How: at a mark whose step sent a page or more of requests
to the engine because their slots met kept blocks (less, and no page could go back: a loss kept every step
moves nothing), the slots that meet a kept block are placed again in the same arena, largest first at the
lowest offset free over their lifetime (as ``greedy-size``), around the slots that stay (another stream's:
at all times), the kept blocks (this move's and earlier ones', now *fixed*: no slot, their frees free no
slot) and the ranges poisoned by another stream's use. A move first waits for the arena's streams: new offsets
may lie on bytes a freed fixed block's streams still touch, or this stream's queued work (a slot put there
with no wait was a silent race on a GPU: attacker 12). Then the runs that no slot and no live block touch go
back, and the engine's idle cache (its copies of the moved slots). The next
kept block sits at the moved slots' bottom, so kept blocks pack as the engine would pack them, the slots
above. The arena reserves :data:`ARENA_VA_FACTOR` times its extent of addresses (addresses cost nothing;
pages do); a move past that, or one whose slots are taken by this step's blocks or a poisoned range, is not
made (the engine keeps serving those slots). A fixed block's pages, once it is freed, go back at the next
move or the plan's drop. Figures (``benchmarks/step_plan_kept``, no limit, held at the
end): 4 GiB, kept once or every tenth step: 8,194 -> 4,098 MiB (unmarked 4,098); 100 MiB, every tenth
(the 202 MiB loop): 202 -> 102 MiB. The cost: each kept block misses the step after it (met before it is
known kept: the slot is held twice then, so the peak stays 8 GiB), where before only the first one did;
moves are at most one per :data:`MISS_WINDOW` planned steps, so they alone never drop a plan.

Note [Arena runs of at most a chunk]
------------------------------------
The arena's pages are mapped as slots first touch them, a run of new pages at a time, and a run goes back
only whole (CUDA unmaps a mapping only whole). A run as long as a 100 MiB temporary was kept whole by one
byte of a block live in it: after a drop, a kept allocation pinned its whole run (attacker 9), and under
memory pressure the ladder's shrink could give back only runs nothing live touches. So runs are cut at the
engine's chunk cap (``chunk_max_fraction`` of the memory held, ``chunk_max_nbytes``, at least a page: Note
[Chunks of several pages] in :mod:`.backing`), as the engine's own chunks are: a live block pins at most a
chunk. The cost is calls, once per plan: GPT-2 fp32's 9.5 GB arena took 829 calls uncut, 1,681 at the
default cap and 13,621 at the memory-first policy's one page (about 0.25 s of driver calls at the H200's
prices, in the first planned step); the memory figures do not move (``reports/sim-step-plan-engine.md``).

Note [A mapping the arena could not undo]
-----------------------------------------
Mapping a run takes three calls (create, map, set access); a failure undoes the earlier ones. When the
undo fails too (set access, then its unmap), the run stays mapped on the device with no access. It was
forgotten: the next slot over those pages mapped them again (``MappingOverlapError``), and once dropped
the arena's reservation could never be freed, so every later mark raised and the layer never planned
again, while ``close()`` reported nothing leaked (attacker 9). Now such a run is booked like any other
(counted in reserved, given back with the arena, the unmap retried then) but no page of it serves: the
layer is *broken*, every allocation goes to the engine, and the next mark drops the plan. A KeyboardInterrupt
or SystemExit of the undo goes on, once the run is booked (attacker 10).
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import itertools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import DeviceLostError, InvalidArgumentError, InvalidPointerError, OutOfMemoryError
from ..validate import as_int, check_int_in_range

log = logging.getLogger(__name__)

__all__ = ["ROUND_NBYTES", "MISS_LIMIT", "MISS_WINDOW", "MISS_WINDOW_LIMIT", "RELEASED_ARENAS", "ARENA_VA_FACTOR",
           "RECORD_LIMIT", "OVERRUN_FACTOR", "EARLY_LEAVE_STEPS", "EARLY_DROPS", "check_record_limit",
           "check_early_leave_steps", "StepState",
           "MarkResult", "PlanItems", "Planner", "plan",
           "plan_height", "first_step_nbytes", "check_plan", "StepTemplate", "template_items", "plan_step", "plan_step_and_height", "plan_room_nbytes", "RefusedPlans", "StepPlan", "PlanInfo",
           "check_generation"]

ROUND_NBYTES = 512
"""Plan offsets and sizes are multiples of the engine's request rounding."""
MAX_ARENA_NBYTES = 1 << 48
"""The largest page size, base or device size the planner takes (256 TiB, a thousand times any GPU's memory):
its sums of offsets and sizes stay within int64."""
MISS_LIMIT = 3
"""Planned steps missed in a row that drop the plan (Note [Step plans])."""
MISS_WINDOW = 8
"""The last planned steps that :data:`MISS_WINDOW_LIMIT` counts misses over."""
MISS_WINDOW_LIMIT = 4
"""Missed steps among the last :data:`MISS_WINDOW` planned ones that drop the plan."""
RELEASED_ARENAS = 8
"""Arenas given back whose address ranges are kept for error messages (Note [Frees into a given-back arena])."""
ARENA_VA_FACTOR = 2
"""An arena reserves this many times its plan's extent of addresses: room to move slots off kept blocks
(Note [Moving slots off kept blocks])."""
RECORD_LIMIT = 1 << 14
"""Allocations a recorded step may hold records of; the next one abandons the recording (Note [When marks
stop]). Per engine: ``set_step_record_limit``."""
OVERRUN_FACTOR = 4
"""A planned step whose allocations pass this many times its template's drops the plan (Note [When marks stop])."""
EARLY_LEAVE_STEPS = 16
"""Planned steps from an install within which a step that leaves the plan drops it (Note [A plan that leaves
early]). The engines' internal ``set_early_leave_steps`` sets it (0: never; the miss-rule tests)."""
EARLY_DROPS = 3
"""Drops in a row for a step that left early, after which the plan's miss rules alone decide (Note [A plan that
leaves early])."""
WARMUP_MARKS = 8
"""Marks of a memory-first warm-up after which it ends with no plan installed (Note [A memory-first warm-up])."""
WARMUP_ALLOCS = RECORD_LIMIT
"""Allocations with no mark (since the warm-up began, or its last mark) that end a memory-first warm-up."""


class _NamedIntEnum(enum.IntEnum):
    """An :class:`enum.IntEnum` whose ``str()`` (what ``print`` shows) is its name, ``MarkResult.READY``:
    Python 3.11's ``IntEnum`` prints the bare value (``1``). Comparisons, ``int()``, JSON and ``format()``
    with a spec (``f"{r:d}"``) keep the value."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __format__(self, spec: str) -> str:
        return str(self) if not spec else int.__format__(int(self), spec)


class StepState(_NamedIntEnum):
    """Where the plan layer is; the values of ``PlanState`` in ``gpumem/_native/engine.h``."""

    OFF = 0
    """No step marked yet, or marks stopped (a step ran past its bound: Note [When marks stop]): the engine
    alone; the next mark starts recording."""
    RECORDING = 1
    """Recording the first step."""
    RECORDING_NEXT = 2
    """Recording the step after a recorded one (whose frees finish the first's lifetimes)."""
    READY = 3
    """Two recorded steps matched: the first waits for :meth:`StepPlan.install`."""
    PLANNED = 4
    """A plan serves the steps."""


class MarkResult(_NamedIntEnum):
    """What :meth:`StepPlan.mark` did."""

    NOTHING = 0
    READY = 1
    """A recorded step waits for its plan (:meth:`StepPlan.template`, :meth:`StepPlan.install`)."""
    DROPPED = 2
    """The plan missed its last :data:`MISS_LIMIT` steps, or :data:`MISS_WINDOW_LIMIT` of its last
    :data:`MISS_WINDOW`: dropped, recording again."""


# -- the planner ------------------------------------------------------------------------------------------

class PlanItems:
    """The allocations a plan places: sizes (rounded) and up to two time segments each, ``[s1, e1)`` and
    ``[s2, e2)`` (``s2 == e2``: one segment), in allocation ranks within the step. A second segment is an
    allocation that lives on into the next step: from its alloc to the step's end, and from the next
    step's start to its free there.

    Raises:
        InvalidArgumentError: arrays of different lengths or not one-dimensional, a size that is not
            positive, a first segment that is empty, a negative start.
    """

    def __init__(self, nbytes: Any, s1: Any, e1: Any, s2: Any, e2: Any) -> None:
        arrs = [np.asarray(a, dtype=np.int64) for a in (nbytes, s1, e1, s2, e2)]
        if any(a.ndim != 1 for a in arrs) or len({len(a) for a in arrs}) != 1:
            raise InvalidArgumentError("PlanItems: nbytes, s1, e1, s2, e2 must be one-dimensional and of one length")
        nb, a1, b1, a2, b2 = arrs
        if (nb <= 0).any():
            raise InvalidArgumentError(f"PlanItems: sizes must be positive, got {int(nb.min())}")
        if (b1 <= a1).any() or (b2 < a2).any() or (a1 < 0).any() or (a2 < 0).any():
            raise InvalidArgumentError("PlanItems: every item needs a first segment s1 < e1, a second s2 <= e2, starts >= 0")
        self.nbytes, self.s1, self.e1, self.s2, self.e2 = nb, a1, b1, a2, b2

    def __len__(self) -> int:
        return len(self.nbytes)

    def subset(self, idx: np.ndarray) -> "PlanItems":
        """The items at ``idx``."""
        return PlanItems(self.nbytes[idx], self.s1[idx], self.e1[idx], self.s2[idx], self.e2[idx])

    def overlapping(self, i: int, among: np.ndarray | None = None) -> np.ndarray:
        """Indices (of ``among``, default all) of the items alive at some time item ``i`` is."""
        idx = np.arange(len(self)) if among is None else among
        s1, e1, s2, e2 = self.s1[idx], self.e1[idx], self.s2[idx], self.e2[idx]
        a1, b1, a2, b2 = self.s1[i], self.e1[i], self.s2[i], self.e2[i]
        hit = (s1 < b1) & (a1 < e1)
        if b2 > a2:
            hit |= (s1 < b2) & (a2 < e1)
        has2 = e2 > s2
        hit |= has2 & (s2 < b1) & (a1 < e2)
        if b2 > a2:
            hit |= has2 & (s2 < b2) & (a2 < e2)
        return idx[hit]

    def max_live_nbytes(self) -> int:
        """The most bytes of these items alive at one time: no plan is lower."""
        if len(self) == 0:
            return 0
        two = self.e2 > self.s2
        times = np.concatenate([self.s1, self.e1, self.s2[two], self.e2[two]])
        deltas = np.concatenate([self.nbytes, -self.nbytes, self.nbytes[two], -self.nbytes[two]])
        order = np.lexsort((deltas, times))  # frees (negative) before allocs at one time
        return int(np.cumsum(deltas[order]).max())


class Planner(str, enum.Enum):
    FIRST_FIT = "first-fit"
    """Items in allocation order, each at the lowest offset free over its lifetime (the simple one)."""
    GREEDY_SIZE = "greedy-size"
    """Largest first (longest lifetime among equals), each at the lowest offset free over its lifetime."""
    GREEDY_BEST = "greedy-best"
    """The lowest of three greedy orders: largest first into the lowest free offset, largest first into
    the smallest gap that fits (TFLite's greedy-by-size), longest-lived first into the lowest offset. Given the
    arena's page size, also each of them with the items that wrap into the next step placed first, and "lowest"
    is then the memory the plan's first step holds (Note [A plan laid out for its first step])."""


def _place(items: PlanItems, order: Sequence[int], best_gap: bool) -> np.ndarray:
    n = len(items)
    offsets = np.full(n, -1, dtype=np.int64)
    placed = np.zeros(n, dtype=bool)
    for i in order:
        size = int(items.nbytes[i])
        others = items.overlapping(int(i), np.flatnonzero(placed))
        if len(others) == 0:
            offsets[i] = 0
            placed[i] = True
            continue
        lo = offsets[others]
        hi = lo + items.nbytes[others]
        o = np.argsort(lo, kind="stable")
        lo, hi = lo[o], hi[o]
        # gaps: [max end so far, next start)
        reach = np.maximum.accumulate(hi)
        gap_lo = np.concatenate(([0], reach[:-1]))
        gap_len = lo - gap_lo
        fits = np.flatnonzero(gap_len >= size)
        if len(fits) == 0:
            offsets[i] = int(reach[-1])
        elif best_gap:
            offsets[i] = int(gap_lo[fits[np.argmin(gap_len[fits])]])
        else:
            offsets[i] = int(gap_lo[fits[0]])
        placed[i] = True
    return offsets


def plan(items: PlanItems, planner: Planner | str = Planner.GREEDY_BEST, page_nbytes: int | None = None,
         base_nbytes: int = 0) -> np.ndarray:
    """An offset per item (bytes; multiples of :data:`ROUND_NBYTES` for rounded sizes) such that no two
    items alive at one time overlap.

    ``page_nbytes``: the arena's page size, for :attr:`Planner.GREEDY_BEST` to choose the layout whose first
    planned step holds least (:func:`first_step_nbytes`; ``base_nbytes``: where these items start in the arena;
    ties go to the lower). None, or items of which none or all wrap into the next step (then the extra orders
    are the same), keeps the lowest: the layout of least :func:`plan_height` (Note [A plan laid out for its
    first step]). The other planners ignore both.

    Raises:
        InvalidArgumentError: an unknown planner, a page size or a base outside ``[1, MAX_ARENA_NBYTES]`` and
            ``[0, MAX_ARENA_NBYTES]`` (:data:`MAX_ARENA_NBYTES`).
    """
    try:
        planner = Planner(planner)
    except ValueError:
        raise InvalidArgumentError(f"unknown planner {planner!r}; choose one of "
                                   f"{', '.join(p.value for p in Planner)}") from None
    if page_nbytes is not None:
        page_nbytes = check_int_in_range(page_nbytes, "plan: page_nbytes", 1, MAX_ARENA_NBYTES)
    base_nbytes = check_int_in_range(base_nbytes, "plan: base_nbytes", 0, MAX_ARENA_NBYTES)
    if planner is Planner.FIRST_FIT:
        order = np.lexsort((np.arange(len(items)), items.s1))
        return _place(items, order.tolist(), best_gap=False)
    length = (items.e1 - items.s1) + (items.e2 - items.s2)
    by_size = np.lexsort((items.s1, -length, -items.nbytes)).tolist()
    if planner is Planner.GREEDY_SIZE:
        return _place(items, by_size, best_gap=False)
    by_length = np.lexsort((items.s1, -items.nbytes, -length))
    tries = [_place(items, by_size, best_gap=False), _place(items, by_size, best_gap=True),
             _place(items, by_length.tolist(), best_gap=False)]
    wraps = items.e2 > items.s2
    if page_nbytes is None or not wraps.any() or wraps.all():
        return min(tries, key=lambda offs: plan_height(items, offs))
    # the same three orders with the items that wrap first (a stable sort keeps each order among them)
    first = [np.concatenate((o[wraps[o]], o[~wraps[o]])) for o in (np.asarray(by_size), by_length)]
    tries += [_place(items, first[0].tolist(), best_gap=False), _place(items, first[0].tolist(), best_gap=True),
              _place(items, first[1].tolist(), best_gap=False)]
    return min(tries, key=lambda offs: (first_step_nbytes(items, offs, page_nbytes, base_nbytes),
                                        plan_height(items, offs)))


def plan_height(items: PlanItems, offsets: np.ndarray) -> int:
    """The arena a plan needs: the highest end of an item (0 for no item)."""
    return int((np.asarray(offsets) + items.nbytes).max()) if len(items) else 0


def first_step_nbytes(items: PlanItems, offsets: np.ndarray, page_nbytes: int, base_nbytes: int = 0) -> int:
    """The most bytes a plan's arena and the leftovers of the step before it hold at once, from its install on
    (Note [A plan laid out for its first step]).

    In the first planned step, at each allocation: the arena's pages touched so far (a page is mapped when a
    slot's first segment starts on it) plus the items that wrap (``e2 > s2``), whose copies from the recorded
    step are live in the engine until their frees at rank ``e2``; later, every page a slot touches. Times are
    allocation ranks within the step, as in :class:`PlanItems`.

    Args:
        items: the plan's items.
        offsets: one byte offset per item, as :func:`plan` returns them (integers, at least 0).
        page_nbytes: the arena's page size (the device's granularity), 1 to :data:`MAX_ARENA_NBYTES`.
        base_nbytes: where these items start in the arena (a stream's items stacked above another's), 0 to
            :data:`MAX_ARENA_NBYTES`; the arena starts on a page.

    Returns:
        Bytes: whole pages plus the leftovers' bytes; 0 for no item.

    Raises:
        InvalidArgumentError: ``offsets`` not one integer per item, a negative offset, a page size or a base out
            of its range.
    """
    page_nbytes = check_int_in_range(page_nbytes, "first_step_nbytes: page_nbytes", 1, MAX_ARENA_NBYTES)
    base_nbytes = check_int_in_range(base_nbytes, "first_step_nbytes: base_nbytes", 0, MAX_ARENA_NBYTES)
    raw = np.asarray(offsets)
    if raw.shape != (len(items),) or (raw.size and raw.dtype.kind not in "iu"):
        raise InvalidArgumentError(f"first_step_nbytes: {len(items)} integer offsets expected (one per item), got "
                                   f"{raw.dtype} of shape {raw.shape}")
    if (raw < 0).any():
        raise InvalidArgumentError("first_step_nbytes: a negative offset")
    if len(items) == 0:
        return 0
    offsets = raw.astype(np.int64) + base_nbytes
    first_page = offsets // page_nbytes
    end_page = (offsets + items.nbytes - 1) // page_nbytes + 1
    # the pages between consecutive item edges are touched together: one entry per such run, not per page
    edges = np.unique(np.concatenate((first_page, end_page)))
    never = np.iinfo(np.int64).max
    touched_at = np.full(len(edges) - 1, never, dtype=np.int64)
    lo, hi = np.searchsorted(edges, first_page), np.searchsorted(edges, end_page)
    for i in np.argsort(items.s1, kind="stable")[::-1]:   # the earliest start written last
        touched_at[lo[i]:hi[i]] = items.s1[i]
    pages = np.diff(edges)[touched_at < never]
    touched_at = touched_at[touched_at < never]
    order = np.argsort(touched_at, kind="stable")
    touched_at, mapped_pages = touched_at[order], np.cumsum(pages[order])
    wraps = items.e2 > items.s2
    ends = np.sort(items.e2[wraps])
    left = np.concatenate((np.cumsum(items.nbytes[wraps][np.argsort(items.e2[wraps], kind="stable")][::-1])[::-1], [0]))
    times = np.unique(items.s1)
    mapped = np.concatenate(([0], mapped_pages))[np.searchsorted(touched_at, times, side="right")] * page_nbytes
    leftover = left[np.searchsorted(ends, times, side="right")]
    return int(max((mapped + leftover).max(), int(mapped_pages[-1]) * page_nbytes))


def check_plan(items: PlanItems, offsets: np.ndarray) -> None:
    """Raise :class:`InvalidArgumentError` when two items alive at one time overlap in the arena (or an
    offset is negative)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    if offsets.shape != (len(items),):
        raise InvalidArgumentError(f"check_plan: {len(items)} items but offsets of shape {offsets.shape}")
    if (offsets < 0).any():
        raise InvalidArgumentError("check_plan: a negative offset")
    for i in range(len(items)):
        o = items.overlapping(i)
        o = o[o != i]
        clash = (offsets[o] < offsets[i] + items.nbytes[i]) & (offsets[i] < offsets[o] + items.nbytes[o])
        if clash.any():
            j = int(o[np.flatnonzero(clash)[0]])
            raise InvalidArgumentError(f"check_plan: items {i} and {j} are alive together and overlap in the arena")


# -- from a recorded step to a plan ------------------------------------------------------------------------

class StepTemplate:
    """A recorded step, per allocation in order: requested bytes, stream, and the allocation rank of its
    free in its own step (``free_own``: how many of the step's allocations came before it; -1: not freed
    there) or in the next step (``free_next``; -1: not freed there either)."""

    def __init__(self, nbytes: Sequence[int], streams: Sequence[int], free_own: Sequence[int],
                 free_next: Sequence[int]) -> None:
        self.nbytes = _int_column(nbytes, "nbytes", np.int64)
        self.streams = _int_column(streams, "streams", np.uint64)
        self.free_own = _int_column(free_own, "free_own", np.int64)
        self.free_next = _int_column(free_next, "free_next", np.int64)
        n = len(self.nbytes)
        if not (n == len(self.streams) == len(self.free_own) == len(self.free_next)):
            raise InvalidArgumentError("StepTemplate: nbytes, streams, free_own and free_next must be of one length")
        if n and (int(self.nbytes.min()) < 0 or int(self.nbytes.max()) > MAX_ARENA_NBYTES):
            raise InvalidArgumentError(f"StepTemplate: every nbytes must be in [0, 2**48] (an arena's most), got "
                                       f"{int(self.nbytes.min())}..{int(self.nbytes.max())}")
        for name, ranks in (("free_own", self.free_own), ("free_next", self.free_next)):
            if n and (int(ranks.min()) < -1 or int(ranks.max()) > n):
                raise InvalidArgumentError(f"StepTemplate: every {name} must be -1 or a rank in [0, {n}] (the step "
                                           f"has {n} allocations), got {int(ranks.min())}..{int(ranks.max())}")

    def __len__(self) -> int:
        return len(self.nbytes)

    def carried_nbytes(self) -> int:
        """Bytes of the step's allocations live at the step's end (freed early in the next step), rounded as the
        plan rounds: live at the mark that plans the step, and given slots by it (:func:`plan_room_nbytes`)."""
        k = np.arange(len(self.nbytes), dtype=np.int64)
        carried = (self.free_own < 0) & (self.free_next >= 0) & (self.free_next <= k)   # planned: template_items
        return int(np.maximum(ROUND_NBYTES, -(-self.nbytes[carried] // ROUND_NBYTES) * ROUND_NBYTES).sum())


def _int_column(values: Any, name: str, dtype: Any) -> np.ndarray:
    """``values`` as a one-dimensional array of ``dtype``: integers only (no floats, bools or strings, which
    would be truncated or parsed), each within ``dtype``'s range."""
    try:
        a = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"StepTemplate: {name} must be a sequence of integers ({exc})") from None
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise InvalidArgumentError(f"StepTemplate: {name} must be a sequence of integers, got "
                                   f"{a.dtype} of shape {a.shape}")
    info = np.iinfo(dtype)
    if a.size and (int(a.min()) < info.min or int(a.max()) > info.max):
        raise InvalidArgumentError(f"StepTemplate: every {name} must be in [{info.min}, {info.max}]")
    return a.astype(dtype, copy=False)


def template_items(t: StepTemplate, round_nbytes: int = ROUND_NBYTES) -> tuple[np.ndarray, PlanItems]:
    """The plannable allocations of ``t`` (their positions in the step) and their :class:`PlanItems`:
    freed in the step (``[k, free_own)``), or in the next step no later than their own slot comes round
    again (``[k, n)`` and ``[0, free_next)``). The rest stays the engine's. Sizes are rounded up to
    ``round_nbytes`` (the engine's policy's, at least :data:`ROUND_NBYTES`), so every offset is a multiple of it."""
    r = max(ROUND_NBYTES, int(round_nbytes))
    n = len(t)
    k = np.arange(n, dtype=np.int64)
    own = t.free_own >= 0
    wrap = ~own & (t.free_next >= 0) & (t.free_next <= k)
    idx = np.flatnonzero(own | wrap)
    sizes = np.maximum(r, -(-t.nbytes[idx] // r) * r)
    w = wrap[idx]
    e1 = np.where(w, n, t.free_own[idx])
    e2 = np.where(w, t.free_next[idx], 0)
    return idx, PlanItems(sizes, k[idx], e1, np.zeros(len(idx), dtype=np.int64), e2)


def engine_rise_nbytes(t: StepTemplate, idx: np.ndarray, round_nbytes: int = ROUND_NBYTES) -> int:
    """The most the engine's live bytes rise above their level at the mark while a planned step runs (Note [The
    room counts whole chunks]): the allocations the plan leaves to the engine (all but ``idx``, the plannable
    ones: :func:`template_items`), less their own frees in the step and the frees, at their ``free_next`` ranks,
    of the previous step's copies of those still live at the mark. Each rounded up to ``round_nbytes``
    (:func:`plan_step_and_height` adds two of the arena's pages where it has one: the engine packs what it
    serves, but beside a full arena its small and its large pool may each need a page of their own); 0 where the
    engine only gives back."""
    n = len(t)
    if n == len(idx):
        return 0
    r = max(ROUND_NBYTES, int(round_nbytes))
    left = np.ones(n, dtype=bool)
    left[idx] = False
    k = np.flatnonzero(left)
    sizes = np.maximum(r, -(-t.nbytes[k] // r) * r)
    after = np.zeros(n + 1, dtype=np.int64)   # after[j]: the change made by allocation j and the frees before it
    np.add.at(after, k, sizes)
    own = t.free_own[k] >= 0
    np.add.at(after, t.free_own[k][own], -sizes[own])
    prev = ~own & (t.free_next[k] >= 0)   # the previous step's copy, live at the mark, goes at this rank
    np.add.at(after, t.free_next[k][prev], -sizes[prev])
    return max(0, int(np.cumsum(after[:n]).max()))


def plan_step(t: StepTemplate, planner: Planner | str = Planner.GREEDY_BEST,
              page_nbytes: int | None = None, limit_nbytes: int | None = None,
              round_nbytes: int = ROUND_NBYTES) -> np.ndarray:
    """The offsets of :func:`plan_step_and_height` (its arguments and errors)."""
    return plan_step_and_height(t, planner, page_nbytes, limit_nbytes, round_nbytes)[0]


def plan_step_and_height(t: StepTemplate, planner: Planner | str = Planner.GREEDY_BEST,
                         page_nbytes: int | None = None, limit_nbytes: int | None = None,
                         round_nbytes: int = ROUND_NBYTES) -> tuple[np.ndarray, int]:
    """An arena offset per allocation of ``t`` (-1: left to the engine): each stream's items planned apart
    and stacked, so that no slot is shared between streams (Note [Step plans]). ``page_nbytes``: the arena's
    page size (the device's granularity), by which the layout is chosen for the plan's first step (Note [A plan
    laid out for its first step]); None: the lowest (least height), as :func:`plan` says. ``limit_nbytes``: the
    room the plan has (:func:`plan_room_nbytes`), past which no slot may end; a plan that cannot end within it
    is no plan, every offset -1 (Note [A plan taller than the device]); None: :data:`MAX_ARENA_NBYTES`.
    ``round_nbytes``: the engine's policy's rounding (``AllocatorPolicy.round_nbytes``), a power of two; sizes
    and offsets are multiples of it where it exceeds :data:`ROUND_NBYTES` (the engine refuses other offsets).
    Also returns what the plan needs in bytes: its height (the streams stacked; 0 with nothing plannable) plus
    the engine's rise during the step (:func:`engine_rise_nbytes`: what the plan leaves to the engine shares
    no memory with the arena), more than ``limit_nbytes`` where the plan was refused.

    Raises:
        InvalidArgumentError: ``t`` not a :class:`StepTemplate`, an unknown planner, a page size or a limit
            outside ``[1, MAX_ARENA_NBYTES]``, a ``round_nbytes`` outside it or not a power of two.
    """
    if not isinstance(t, StepTemplate):
        raise InvalidArgumentError(f"plan_step: t must be a StepTemplate, not {type(t).__name__}")
    try:
        planner = Planner(planner)
    except ValueError:
        raise InvalidArgumentError(f"unknown planner {planner!r}; choose one of "
                                   f"{', '.join(p.value for p in Planner)}") from None
    if page_nbytes is not None:
        page_nbytes = check_int_in_range(page_nbytes, "plan_step: page_nbytes", 1, MAX_ARENA_NBYTES)
    round_nbytes = check_int_in_range(round_nbytes, "plan_step: round_nbytes", 1, MAX_ARENA_NBYTES)
    if round_nbytes & (round_nbytes - 1):
        raise InvalidArgumentError(f"plan_step: round_nbytes must be a power of two, got {round_nbytes}")
    bound = MAX_ARENA_NBYTES if limit_nbytes is None else check_int_in_range(
        limit_nbytes, "plan_step: limit_nbytes", 1, MAX_ARENA_NBYTES)
    offsets = np.full(len(t), -1, dtype=np.int64)
    idx, items = template_items(t, round_nbytes)
    if len(idx) == 0:
        return offsets, 0
    r = max(ROUND_NBYTES, round_nbytes)
    rise = engine_rise_nbytes(t, idx, r)
    if rise and page_nbytes:   # the engine packs them, but may need a page of its own in each pool beside the arena
        rise += 2 * page_nbytes
    stacked = _stack_streams(t, idx, items, planner, page_nbytes, r)
    if stacked[1] + rise > bound and page_nbytes is not None:   # the lowest layouts may still fit
        stacked = _stack_streams(t, idx, items, planner, None, r)
    if stacked[1] + rise > bound:
        log.info("plan_step: the step's plan (%d allocations, %d B stacked over %d stream(s), beside %d B the engine "
                 "serves) ends past its room of %d B: nothing is planned, the engine serves the step", len(idx),
                 stacked[1], len(np.unique(t.streams[idx])), rise, bound)
        return offsets, stacked[1] + rise
    offsets[idx] = stacked[0]
    return offsets, stacked[1] + rise


def _stack_streams(t: StepTemplate, idx: np.ndarray, items: PlanItems, planner: Planner,
                   page_nbytes: int | None, round_nbytes: int) -> tuple[np.ndarray, int]:
    """Each stream's items of ``items`` (at ``idx`` in ``t``) planned apart, stacked in stream order: their
    offsets (in ``items``' order) and the stack's height, every stream's rounded to ``round_nbytes``."""
    offs_all = np.empty(len(idx), dtype=np.int64)
    base = 0
    for s in np.unique(t.streams[idx]):
        mine = np.flatnonzero(t.streams[idx] == s)
        sub = items.subset(mine)
        if base > MAX_ARENA_NBYTES:   # past every room: no need to plan the rest
            return offs_all, base
        offs = plan(sub, planner, page_nbytes, base)
        offs_all[mine] = offs + base
        base += -(-plan_height(sub, offs) // round_nbytes) * round_nbytes
    return offs_all, base


def plan_room_nbytes(total_nbytes: int, free_nbytes: int | None = None, reserved_nbytes: int = 0,
                     allocated_nbytes: int = 0, limit_nbytes: int | None = None, carried_nbytes: int = 0,
                     releasable_nbytes: int | None = None) -> int:
    """The most a step plan's arena may hold at a mark (``plan_step``'s ``limit_nbytes``; Note [A plan taller
    than the device]): the device's ``total_nbytes``; where ``free_nbytes`` is known (other tenants included),
    at most the free bytes plus what the engine holds (``reserved_nbytes``) less its live bytes that stay
    (``allocated_nbytes`` less ``carried_nbytes``, the step's own allocations still live at the mark, which the
    plan has slots for: :meth:`StepTemplate.carried_nbytes`); where the allocator has a ``limit_nbytes``, at most
    what it leaves beside those live bytes. Where ``releasable_nbytes`` is known (the engine's
    ``releasable_nbytes(with_carried=True)``: what giving its cache back would release, were the carried
    allocations freed), the engine's part is that, at most ``reserved_nbytes`` less the live bytes that stay
    (so it counts only with ``reserved_nbytes`` given), and under a limit what it keeps after that release
    counts against it (Note [The room counts whole chunks]). At least 1 (an empty room plans nothing), at most
    :data:`MAX_ARENA_NBYTES`.

    Raises:
        InvalidArgumentError: an argument that is not an int (None allowed for ``free_nbytes``,
            ``limit_nbytes`` and ``releasable_nbytes``) in ``[0, 2**64)`` (``total_nbytes``: at least 1).
    """
    total_nbytes = check_int_in_range(total_nbytes, "plan_room_nbytes: total_nbytes", 1, (1 << 64) - 1)
    reserved_nbytes, allocated_nbytes, carried_nbytes = (
        check_int_in_range(v, f"plan_room_nbytes: {name}", 0, (1 << 64) - 1)
        for name, v in (("reserved_nbytes", reserved_nbytes), ("allocated_nbytes", allocated_nbytes),
                        ("carried_nbytes", carried_nbytes)))
    if free_nbytes is not None:
        free_nbytes = check_int_in_range(free_nbytes, "plan_room_nbytes: free_nbytes", 0, (1 << 64) - 1)
    if limit_nbytes is not None:
        limit_nbytes = check_int_in_range(limit_nbytes, "plan_room_nbytes: limit_nbytes", 0, (1 << 64) - 1)
    if releasable_nbytes is not None:
        releasable_nbytes = check_int_in_range(releasable_nbytes, "plan_room_nbytes: releasable_nbytes", 0,
                                               (1 << 64) - 1)
    staying = max(0, int(allocated_nbytes) - int(carried_nbytes))
    cache = max(0, int(reserved_nbytes) - staying)   # what the engine holds beyond its live bytes that stay
    movable = cache   # of which only whole chunks move (Note [The room counts whole chunks])
    if releasable_nbytes is not None:
        movable = min(cache, int(releasable_nbytes))
    room = int(total_nbytes)
    if free_nbytes is not None:
        room = min(room, int(free_nbytes) + movable)
    if limit_nbytes is not None:   # what the engine keeps after its release counts against the limit
        room = min(room, int(limit_nbytes) - staying - (cache - movable))
    return max(1, min(room, MAX_ARENA_NBYTES))


class RefusedPlans:
    """The last step :func:`plan_step` refused for want of room, so that a mark does not plan the same step
    again while the room is no larger (Note [A plan taller than the device]): its fingerprint (sizes, streams
    and the frees' ranks: what the plan's height depends on) and the room it had. Only the last refused step
    is kept (a program whose refused steps alternate plans each again), and any growth of the room, a page
    or more, plans it again. One per allocator and device; thread-safe (marks may come from threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: tuple[bytes, int] | None = None   # guarded by _lock

    @staticmethod
    def fingerprint(t: StepTemplate) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        h.update(np.ascontiguousarray(t.nbytes).tobytes())
        for a in (t.streams, t.free_own, t.free_next):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.digest()

    def worth_planning(self, t: StepTemplate, room_nbytes: int) -> bool:
        """Whether ``t`` may fit ``room_nbytes``: False for the step last refused, unless the room grew."""
        with self._lock:
            last = self._last
        return last is None or last[1] < room_nbytes or last[0] != self.fingerprint(t)

    def note(self, t: StepTemplate, room_nbytes: int, offsets: np.ndarray) -> bool:
        """Remember what ``plan_step`` answered for ``t`` in ``room_nbytes``: a refusal (every offset -1 where
        something was plannable) is kept, any other answer forgets it. Returns whether it was a new refusal
        (the caller warns once per step)."""
        refused = bool(len(offsets)) and not bool((offsets >= 0).any()) and len(template_items(t)[0]) > 0
        key = (self.fingerprint(t), int(room_nbytes)) if refused else None
        with self._lock:
            new = refused and (self._last is None or self._last[0] != key[0])
            self._last = key
        return new


# -- the plan layer of the Python engine -------------------------------------------------------------------

class PlanInfo:
    """The plan layer's counters (``CachingAllocator.step_plan_info()``), the same in both engines.

    Each field reads as an attribute (``info.served``); ``info.state`` is a :class:`StepState`, and
    :meth:`as_dict` keeps plain ints (the JSON records of ``hil/probes`` store it). ``live_nbytes``: bytes
    of live allocations in the step plan's arenas (the current one and dropped ones not yet given back),
    which ``mapped_nbytes`` holds beside the engine's cache. ``records``: allocations of the recorded steps
    held (host memory, at most twice :data:`RECORD_LIMIT`); ``recordings_abandoned``: recorded steps that ran
    past that limit (Note [When marks stop]); ``implicit_steps``: planned steps started with no mark, by an
    allocation after the last slot that fits slot 0 (Note [An implicit step restart]); ``warmup``: 1 while the
    engine grows memory-first until a plan forms (Note [A memory-first warm-up]), else 0."""

    FIELDS = ("state", "slots", "arena_nbytes", "mapped_nbytes", "served", "fallback", "steps_hit",
              "steps_missed", "plans_installed", "plans_dropped", "arena_calls", "live_nbytes", "records",
              "recordings_abandoned", "implicit_steps", "warmup")

    def __init__(self, values: Sequence[int]) -> None:
        if len(values) != len(self.FIELDS):
            raise InvalidArgumentError(f"PlanInfo: {len(self.FIELDS)} values expected, got {len(values)}")
        self.values = tuple(int(v) for v in values)

    def as_dict(self) -> dict[str, int]:
        """The fields by name, every value a plain int (``state`` too: see :attr:`state_name`)."""
        return dict(zip(self.FIELDS, self.values))

    @property
    def state(self) -> StepState:
        return StepState(self.values[0])

    @property
    def state_name(self) -> str:
        """The state's name, ``"PLANNED"``."""
        return self.state.name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PlanInfo) and other.values == self.values

    def __hash__(self) -> int:
        return hash(self.values)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in zip(self.FIELDS[1:], self.values[1:]))
        return f"PlanInfo(state={self.state_name}, {fields})"

    def __getattr__(self, name: str) -> int:
        try:
            return self.values[self.FIELDS.index(name)]
        except ValueError:
            raise AttributeError(name) from None


class _Arena:
    """An address reservation whose pages are mapped as slots first touch them."""

    def __init__(self, base: int, nbytes: int, page_nbytes: int, streams: set[int], extent_nbytes: int) -> None:
        self.base, self.nbytes, self.g = base, nbytes, page_nbytes
        self.extent_nbytes = extent_nbytes
        """The plan's extent in the reservation (``nbytes``), pages rounded: ``PlanInfo.arena_nbytes``."""
        self.pages: list[Any] = [None] * (nbytes // page_nbytes)
        self.runs: list[list[Any]] = []   # [va, nbytes, handle, unmapped], in mapping order
        self.mapped_nbytes = 0
        self.streams = set(streams)
        self.live: dict[int, tuple[int, int, int]] = {}   # ptr -> (slot, size, requested); slot -1: fixed
        self.dropped = False

    def holds(self, ptr: int) -> bool:
        return self.base <= ptr < self.base + self.nbytes


class _Ranges:
    """Disjoint address ranges ``[start, end)`` with a slot each, sorted by start: whether a range meets one
    of them is a binary search (the native engine keeps the live slots in a Fenwick tree over the slots'
    starts, sorted at install: the same answers)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.at: dict[int, tuple[int, int]] = {}   # start -> (end, slot)

    def meeting(self, lo: int, hi: int) -> int:
        """The slot of the range that meets ``[lo, hi)``, -1 for none: only the range starting last below
        ``hi`` can (disjoint ranges sorted by start end in that order too)."""
        i = bisect.bisect_left(self.starts, hi) - 1
        if i < 0:
            return -1
        end, slot = self.at[self.starts[i]]
        return slot if end > lo else -1

    def add(self, lo: int, hi: int, slot: int) -> None:
        bisect.insort(self.starts, lo)
        self.at[lo] = (hi, slot)

    def remove(self, lo: int) -> None:
        del self.starts[bisect.bisect_left(self.starts, lo)]
        del self.at[lo]


class StepPlan:
    """The plan layer of :class:`~.python_engine.PythonEngine` (Note [Step plans]); every method runs under
    the engine's lock (an RLock) and is the reference of ``Engine::plan_*`` in ``gpumem/_native/engine.cpp``."""

    def __init__(self, engine: Any) -> None:
        self.e = engine
        """The :class:`~.python_engine.PythonEngine` it sits in front of (not imported here: no cycle)."""
        self.state = StepState.OFF
        self.generation = 0
        """Counts the marks that made a step READY: :meth:`install` of a stale one installs nothing."""
        self._reset_recording()
        self.arenas: list[_Arena] = []   # the current plan's last; dropped ones until their last free
        self._clear_slots()
        self.mapped_nbytes = 0
        self.released: list[tuple[int, int]] = []
        """``(base, nbytes)`` of the last :data:`RELEASED_ARENAS` arenas given back, oldest first."""
        self.counts = dict.fromkeys(("served", "fallback", "steps_hit", "steps_missed", "plans_installed",
                                     "plans_dropped", "arena_calls", "moves", "recordings_abandoned",
                                     "implicit_steps"), 0)
        self.record_limit = RECORD_LIMIT
        """Records a recorded step may hold (Note [When marks stop]): :meth:`set_record_limit`."""
        self.early_drops = 0
        """Plans dropped in a row for a step that left them early (Note [A plan that leaves early])."""
        self.early_leave_steps = EARLY_LEAVE_STEPS
        """Planned steps within which a leave drops the plan (0: never): :meth:`set_early_leave_steps`."""
        self.warmup_marks = 0
        """Marks since the memory-first warm-up began (Note [A memory-first warm-up])."""
        self.warmup_since = 0
        """The engine's ``num_allocs`` when the warm-up began or last saw a mark."""
        self.warmup_done = False
        """A warm-up ran and ended: none begins again."""
        self.history_streams: dict[int, int] = {}
        """With the engine's history recorded (``record_history``): each live arena pointer's stream, for its free."""

    def _reset_recording(self) -> None:
        self.cur: list[list[int]] = []     # [nbytes, stream, free_own, free_next]
        self.prev: list[list[int]] = []
        self.cur_map: dict[int, int] = {}
        self.prev_map: dict[int, int] = {}
        self.cur_cross = self.prev_cross = False   # a recorded step used record_stream on another stream
        self.since_mark = 0

    def _clear_slots(self) -> None:
        self.off: list[int] = []
        self.size: list[int] = []
        self.stream: list[int] = []
        self.occupied = _Ranges()   # the live slots' ranges in the arena (offsets)
        self.poisoned: list[bool] = []
        self.served_in: list[int] = []   # the planned step (planned_steps) each slot was last served in
        self.cursor = 0
        self.left = False
        self.missed = False
        self.miss_bits = 0   # the last MISS_WINDOW planned steps, 1 for a miss (the newest lowest)
        self.planned_steps = 0
        self.broken = False   # a mapping of the arena could not be undone: drop at the next mark
        self.e1: list[int] = []   # per slot, its lifetime in ranks: [k, e1) and, when e2, [0, e2)
        self.e2: list[int] = []
        self.blocked_nbytes = 0   # this step's requests served by the engine because their slot met a kept block
        self.moved_at = -1   # the planned step of the last move off kept blocks (-1: none)

    def set_early_leave_steps(self, steps: Any) -> None:
        """Planned steps from an install within which a step that leaves the plan drops it (Note [A plan that
        leaves early]; default :data:`EARLY_LEAVE_STEPS`, 0: never, the miss rules alone)."""
        self.early_leave_steps = check_early_leave_steps(steps)

    def set_record_limit(self, records: Any) -> None:
        """Records a recorded step may hold before it is abandoned (default :data:`RECORD_LIMIT`); a step
        recording now that already holds more is abandoned at its next allocation."""
        self.record_limit = check_record_limit(records)

    @property
    def active(self) -> bool:
        """Whether allocations and frees must pass through the plan layer."""
        return self.state is not StepState.OFF or bool(self.arenas)

    def _current(self) -> _Arena | None:
        return self.arenas[-1] if self.state is StepState.PLANNED else None

    # -- marks ------------------------------------------------------------------------------------------
    def mark(self) -> MarkResult:
        """A step boundary; then gives back every dropped arena with nothing live (a drop's, or one whose
        give-back failed before: Note [Step plans], a failed give-back) and, of the others, every run no live
        allocation touches (Note [Arena runs of at most a chunk])."""
        result = self._mark()
        self._give_back_dropped()
        return result

    # -- Note [A memory-first warm-up] ----------------------------------------------------------------------
    def start_warmup(self) -> bool:
        """Begin the memory-first warm-up where the policy asks for one (``plan_warmup``, ``growth=CHUNKS``,
        ``steal_empty_pages``: without steals one-page chunks cost calls and hold as much) and none ran before and
        no plan is installed; whether it is on now."""
        self.check_warmup()
        b = self.e.backing
        if (not b.warmup and not self.warmup_done and self.state is not StepState.PLANNED
                and self.e.policy.plan_warmup and self.e.policy.steal_empty_pages and getattr(b, "chunked", False)):
            b.warmup = True
            self.warmup_marks = 0
            self.warmup_since = self.e._stats.num_allocs
        return b.warmup

    def end_warmup(self, planned: bool) -> None:
        """End the warm-up: the stream-ordered steal stays on where the policy says so (``steal_after_warmup``, the
        default); with no plan (``planned`` False) and the policy's ``warmup_give_back`` (the default), give the
        engine's idle cache back, so that its one-page chunks do not outlive it."""
        if self.e.backing.warmup:
            self.e.backing.warmup = False
            self.warmup_done = True
            self.e.backing.warmup_ended = True   # no more steal_before_warmup (Note [The ordered steal before a warm-up])
            if self.e.policy.steal_after_warmup:
                self.e.backing.after_warmup = True   # Note [The ordered steal after a warm-up] in backing.py
            if not planned and self.e.policy.warmup_give_back:
                self.e._empty_cache_locked()

    def stop_warmup(self) -> bool:
        """Stop the warm-up as if it had not begun (automatic marks turned off): the idle cache goes back, and a
        later mark or ``start_plan_warmup()`` may begin it again. Whether it was on. A warm-up already past
        :data:`WARMUP_ALLOCS` allocations with no mark has ended (:meth:`check_warmup`, which only the slow path
        ran): it is ended here, not stopped, so that none begins again (as ``PlanInfo.warmup`` already said)."""
        self.check_warmup()
        if not self.e.backing.warmup:
            return False
        self.e.backing.warmup = False
        self.e._empty_cache_locked()
        return True

    def check_warmup(self) -> None:
        """Before the engine grows (its slow path): past :data:`WARMUP_ALLOCS` allocations with no mark, the
        warm-up ends."""
        if self.e.backing.warmup and self.e._stats.num_allocs - self.warmup_since >= WARMUP_ALLOCS:
            self.end_warmup(False)

    def _mark(self) -> MarkResult:
        if self.start_warmup():  # the first mark begins it; each counts
            self.warmup_marks += 1
            self.warmup_since = self.e._stats.num_allocs
            if self.warmup_marks >= WARMUP_MARKS:
                self.end_warmup(False)
        s = self.state
        if s is StepState.OFF or s is StepState.READY:
            self._reset_recording()
            self.state = StepState.RECORDING
            return MarkResult.NOTHING
        if s is StepState.RECORDING:
            self._slide()
            self.state = StepState.RECORDING_NEXT
            return MarkResult.NOTHING
        if s is StepState.RECORDING_NEXT:
            if self.prev and not self.prev_cross and not self.cur_cross and len(self.prev) == len(self.cur) and all(
                    a[0] == b[0] and a[1] == b[1] for a, b in zip(self.prev, self.cur)):
                self.state = StepState.READY
                self.generation += 1
                self.since_mark = 0
                return MarkResult.READY
            self._slide()
            return MarkResult.NOTHING
        # PLANNED
        if self._end_step():
            self._drop()
            self._reset_recording()
            self.state = StepState.RECORDING
            return MarkResult.DROPPED
        return MarkResult.NOTHING

    def _step_hit(self) -> bool:
        """Whether the planned step now ending stayed on the plan: every allocation on its slot, none served by
        the engine; a step that ends before its last slot is a hit too (Note [A step that ends early])."""
        return not self.missed and not self.left

    def _drops(self, miss_bits: int) -> bool:
        """Whether a step end leaving ``miss_bits`` drops the plan (Note [Step plans])."""
        last = (1 << MISS_LIMIT) - 1
        return self.broken or miss_bits & last == last or bin(miss_bits).count("1") >= MISS_WINDOW_LIMIT

    def _end_step(self) -> bool:
        """End the planned step (a mark, or an implicit restart: Note [An implicit step restart]): count it hit
        or missed; True when that drops the plan (the caller drops it), else the next step starts at slot 0
        and the slots under kept blocks may move (Note [Moving slots off kept blocks])."""
        hit = self._step_hit()
        self.counts["steps_hit" if hit else "steps_missed"] += 1
        self.miss_bits = ((self.miss_bits << 1) | (not hit)) & ((1 << MISS_WINDOW) - 1)
        if self.planned_steps == 0:
            self.e._empty_cache_locked()   # the leftovers of the last step before the plan
        self.planned_steps += 1
        if self.planned_steps >= self.early_leave_steps:
            self.early_drops = 0   # this plan lived: a later early leave drops again (Note [A plan that leaves early])
        if self._drops(self.miss_bits):
            return True
        self.cursor = 0
        self.left = self.missed = False
        blocked, self.blocked_nbytes = self.blocked_nbytes, 0
        if blocked >= self.arenas[-1].g and (self.moved_at < 0 or self.planned_steps - self.moved_at >= MISS_WINDOW):
            self._move_off_kept()
        return False

    def _move_off_kept(self) -> None:
        """Move the slots that meet a kept block elsewhere in the arena, the kept blocks fixed where they are;
        give back the runs nothing uses then, and the engine's idle cache (Note [Moving slots off kept blocks])."""
        arena = self.arenas[-1]
        base, ps, n = arena.base, self.planned_steps, len(self.off)
        off, size, stream, e1, e2 = self.off, self.size, self.stream, self.e1, self.e2
        kept = sorted((ptr - base, sz, k) for ptr, (k, sz, _) in arena.live.items() if k >= 0 and ps - self.served_in[k] >= 2)
        if not kept:
            return
        kept_slots = {k for _, _, k in kept}
        move = [k for k in range(n) if off[k] >= 0 and any(o < off[k] + size[k] and off[k] < o + sz for o, sz, _ in kept)]
        for k in move:   # a slot taken by anything but its kept block (live in this step, or poisoned) stays
            taken = self.occupied.at.get(off[k])
            if taken is not None and taken[1] == k and k not in kept_slots:
                return
        # always in the way: kept blocks (this move's and earlier ones'), ranges poisoned and freed
        always = [(o, o + sz) for o, sz, _ in kept]
        always += [(ptr - base, ptr - base + sz) for ptr, (k, sz, _) in arena.live.items() if k < 0]
        always += [(lo, self.occupied.at[lo][0]) for lo in self.occupied.starts if base + lo not in arena.live]
        moving = set(move)
        stay = [j for j in range(n) if off[j] >= 0 and j not in moving]

        def meets(i: int, j: int) -> bool:
            """Whether slots ``i`` and ``j`` may not share bytes: other streams, or alive together."""
            if stream[i] != stream[j]:
                return True
            si = [(i, e1[i])] + ([(0, e2[i])] if e2[i] else [])
            sj = [(j, e1[j])] + ([(0, e2[j])] if e2[j] else [])
            return any(a < d and c < b for a, b in si for c, d in sj)

        placed: dict[int, int] = {}
        for i in sorted(move, key=lambda k: (-size[k], -((e1[k] - k) + e2[k]), k)):
            ranges = list(always)
            ranges += [(off[j], off[j] + size[j]) for j in stay if meets(i, j)]
            ranges += [(o, o + size[j]) for j, o in placed.items() if meets(i, j)]
            ranges.sort()
            reach = 0
            for lo, hi in ranges:
                if lo - reach >= size[i]:
                    break
                reach = max(reach, hi)
            placed[i] = reach
        top = max([off[j] + size[j] for j in stay] + [o + size[i] for i, o in placed.items()] + [hi for _, hi in always])
        g = arena.g
        extent = -(-top // g) * g
        if extent > arena.nbytes:   # no room left in the reservation: the engine keeps serving those slots
            return
        # the new offsets may lie on bytes other streams' work (or this stream's, still queued) touched: wait
        # for the arena's streams first (review attacker 12, F1)
        dev = self.e.device
        for st in sorted(arena.streams):
            dev.stream_synchronize(st)
        for o, sz, k in kept:
            _, _, nbytes = arena.live[base + o]
            arena.live[base + o] = (-1, sz, nbytes)
            self.occupied.remove(o)
        for i, o in placed.items():
            off[i] = o
            self.poisoned[i] = False
        arena.extent_nbytes = extent
        self.moved_at = ps
        self.counts["moves"] += 1
        # the runs no slot and no live block touches go back (after the arena's streams), then the engine's idle cache
        used = sorted([(off[k], off[k] + size[k]) for k in range(n) if off[k] >= 0]
                      + [(ptr - base, ptr - base + sz) for ptr, (_, sz, _) in arena.live.items()])
        starts = [lo for lo, _ in used]
        reach_at = list(itertools.accumulate((hi for _, hi in used), max))
        idle = []
        for i, (va, nb, _, _) in enumerate(arena.runs):
            lo, hi = va - base, va - base + nb
            j = bisect.bisect_left(starts, hi) - 1   # the ranges starting below hi: one reaching past lo meets it
            if j < 0 or reach_at[j] <= lo:
                idle.append(i)
        for i in reversed(idle):   # the arena's streams were waited for above
            self._give_back_run(arena, i)
        self.e._empty_cache_locked()

    def _slide(self) -> None:
        self.prev, self.prev_map, self.prev_cross = self.cur, self.cur_map, self.cur_cross
        self.cur, self.cur_map, self.cur_cross = [], {}, False

    def template(self, missing_ok: bool = False) -> StepTemplate | None:
        """The READY step (its generation is :attr:`generation`); None with ``missing_ok`` when no step waits
        (another thread's mark took it: Note [Step plans and threads])."""
        if self.state is not StepState.READY:
            if missing_ok:
                return None
            raise InvalidArgumentError("step_template: no recorded step waits for a plan (mark_step returns READY "
                                       "when two recorded steps match)")
        p = self.prev
        return StepTemplate([r[0] for r in p], [r[1] for r in p], [r[2] for r in p], [r[3] for r in p])

    # -- install -------------------------------------------------------------------------------------------
    def install(self, offsets: Sequence[int], generation: int | None = None) -> bool:
        """Install a plan for the READY template: ``offsets[k]`` (-1: the engine's) per allocation. With
        ``generation`` (:attr:`generation` when the template was read), a READY step that went away or was
        replaced (another thread's mark) installs nothing and returns False (Note [Step plans and threads]).

        Raises:
            InvalidArgumentError: no template waits (without ``generation``), a length or an offset that is
                wrong, an offset for an allocation not freed within two steps, two slots alive together that
                overlap in the arena, or a plan that places nothing; nothing changes then.
        """
        if generation is not None and (self.state is not StepState.READY or generation != self.generation):
            return False
        if self.state is not StepState.READY:
            raise InvalidArgumentError("install_plan: no recorded step waits for a plan (mark_step returns READY "
                                       "when two recorded steps match)")
        rec = self.prev
        n = len(rec)
        offs = [int(o) for o in offsets]
        if len(offs) != n:
            raise InvalidArgumentError(f"install_plan: the recorded step has {n} allocations, got {len(offs)} offsets")
        r = self.e.policy.round_nbytes
        sizes, e1, e2 = [0] * n, [0] * n, [0] * n
        total = self.e.device.properties().total_nbytes
        for k, (nb, _, fo, fn) in enumerate(rec):
            sizes[k] = -(-nb // r) * r
            o = offs[k]
            if o == -1:
                continue
            if o < 0 or o % r or o > (1 << 62):
                raise InvalidArgumentError(f"install_plan: offset {o} of slot {k} is not -1 or a multiple of {r} B")
            if o + sizes[k] > total:   # the arena could never be mapped: refused before reserving it
                raise InvalidArgumentError(f"install_plan: offset {o} of slot {k} ({sizes[k]} B) ends past the "
                                           f"device's {total} B: no arena that large can be mapped")
            if fo >= 0:
                e1[k] = fo
            elif 0 <= fn <= k:
                e1[k], e2[k] = n, fn
            else:
                raise InvalidArgumentError(f"install_plan: slot {k} is not freed within its step or early in the next: "
                                           "it cannot be planned (give it offset -1)")
        planned = sorted((offs[k], k) for k in range(n) if offs[k] >= 0)
        if not planned:
            raise InvalidArgumentError("install_plan: the plan places no allocation")
        _check_slots(planned, sizes, e1, e2)
        streams = [rec[k][1] for k in range(n)]
        refused = _refused_slots(planned, sizes, streams, n)
        height = max((o + sizes[k] for o, k in planned if not refused[k]), default=0)
        if height == 0:
            raise InvalidArgumentError("install_plan: every slot of the plan meets another stream's")
        g = self.e.device.properties().granularity_nbytes
        arena_nbytes = -(-height // g) * g
        base = self.e.device.address_reserve(arena_nbytes * ARENA_VA_FACTOR)
        self.counts["arena_calls"] += 1
        self.arenas.append(_Arena(base, arena_nbytes * ARENA_VA_FACTOR, g,
                                  {streams[k] for _, k in planned if not refused[k]}, arena_nbytes))
        self.off = [o if o >= 0 and not refused[k] else -1 for k, o in enumerate(offs)]
        self.size, self.stream = sizes, streams
        self.e1, self.e2 = e1, e2
        self.blocked_nbytes, self.moved_at = 0, -1
        self.occupied = _Ranges()
        self.poisoned = [False] * n
        self.served_in = [0] * n
        self.cursor, self.miss_bits, self.planned_steps = 0, 0, 0
        self.missed = self.broken = False
        self.left = self.since_mark > 0   # allocations came between the mark and the install: not this step
        self.state = StepState.PLANNED
        self.counts["plans_installed"] += 1
        self.end_warmup(True)
        self.prev, self.prev_map, self.cur, self.cur_map = [], {}, [], {}
        self.cur_cross = self.prev_cross = False
        return True

    # -- the hot path -------------------------------------------------------------------------------------
    def allocate(self, nbytes: int, stream: int) -> int:
        """Under the engine's lock, arguments checked; the engine serves what the plan does not."""
        e = self.e
        if self.state is StepState.PLANNED and e._lost is None and not e._closed and not e.device.closed:
            was_left = self.left
            ptr = self._serve(nbytes, stream)
            if ptr:
                return ptr
            self.counts["fallback"] += 1
            if self.cursor > OVERRUN_FACTOR * len(self.off):   # marks stopped? (Note [When marks stop])
                self._drop()
                self._reset_recording()
                self.state = StepState.OFF
                self._give_back_dropped()
            elif (self.left and not was_left and self.planned_steps < self.early_leave_steps   # Note [A plan that
                  and self.early_drops < EARLY_DROPS                                             # leaves early]
                  and not e._never_fits(e._rounded(nbytes))):
                self.early_drops += 1
                self._drop()
                self._reset_recording()
                self.state = StepState.RECORDING
                try:
                    self._give_back_dropped()
                except DeviceLostError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the runs stay held: the next mark gives them back
                    log.debug("could not give back a plan dropped early; the next mark retries: %s", exc)
        ptr = e._allocate_engine(nbytes, stream)
        self.since_mark += 1
        if self.state is StepState.RECORDING or self.state is StepState.RECORDING_NEXT:
            if len(self.cur) >= self.record_limit:   # marks stopped? (Note [When marks stop])
                self._reset_recording()
                self.state = StepState.OFF
                self.counts["recordings_abandoned"] += 1
            else:
                self.cur_map[ptr] = len(self.cur)
                self.cur.append([nbytes, stream, -1, -1])
        return ptr

    def _serve(self, nbytes: int, stream: int) -> int:
        k = self.cursor
        if k == len(self.off) and self._restarts(nbytes, stream):
            self.counts["implicit_steps"] += 1
            self._end_step()   # no drop: _restarts checked it
            k = 0
        self.cursor = k + 1
        if self.broken:
            self.missed = True
            return 0
        if self.left or k >= len(self.off):
            self.left = True
            return 0
        if nbytes > self.size[k] or stream != self.stream[k]:
            self.left = True
            return 0
        off = self.off[k]
        if off < 0:
            return 0
        size = self.size[k]
        j = self.occupied.meeting(off, off + size)
        if j >= 0:   # a live slot (this one, still taken, or another)
            if self.planned_steps - self.served_in[j] < 2 or (self.poisoned[j] and not self._slot_live(j)):
                self.missed = True
            else:   # kept past every planned lifetime: served by the engine, not a miss (Note [Allocations
                self.blocked_nbytes += size   # kept past their step]); the slot may move (Note [Moving slots ...])
            return 0
        arena = self.arenas[-1]
        try:
            mapped = self._map(arena, off, size)
        except BaseException:
            self.missed = True   # the allocation fails: the step is not served by the plan
            raise
        if not mapped:
            self.missed = True
            return 0
        ptr = arena.base + off
        self.occupied.add(off, off + size, k)
        self.served_in[k] = self.planned_steps
        arena.live[ptr] = (k, size, nbytes)
        e = self.e
        e._stats.count_allocation(size, nbytes, e.backing.reserved_nbytes + self.mapped_nbytes)
        self.counts["served"] += 1
        if e._recorder is not None:   # the history holds the plan's allocations too (record_history)
            e._recorder.record_alloc(ptr, nbytes, stream)
            self.history_streams[ptr] = stream
        return ptr

    def _restarts(self, nbytes: int, stream: int) -> bool:
        """Whether the allocation after the planned step's last slot starts a new planned step (Note [An
        implicit step restart]): the step stayed on the template's sequence (not left, not broken), the
        request is slot 0's (its rounded size exactly, its stream, no live arena allocation over the slot), and
        ending the step here would not drop the plan."""
        if self.left or self.broken:
            return False
        r = self.e.policy.round_nbytes   # slot 0's own size, not any that fits: no mark to go by (Note)
        if -(-nbytes // r) * r != self.size[0] or stream != self.stream[0]:
            return False
        off = self.off[0]
        if off >= 0 and self.occupied.meeting(off, off + self.size[0]) >= 0:
            return False
        return not self._drops(((self.miss_bits << 1) | (not self._step_hit())) & ((1 << MISS_WINDOW) - 1))

    def _slot_live(self, k: int) -> bool:
        """Whether slot ``k``'s allocation in the current arena is live (a poisoned slot stays taken after its free)."""
        entry = self.arenas[-1].live.get(self.arenas[-1].base + self.off[k])
        return entry is not None and entry[0] == k

    def _map(self, arena: _Arena, off: int, size: int) -> bool:
        """Map the unmapped pages under ``[off, off + size)``, after the engine gave its idle cache back;
        False when the limit or the device refuses memory (the engine serves the request then)."""
        g = arena.g
        first, last = off // g, (off + size - 1) // g
        todo = [p for p in range(first, last + 1) if arena.pages[p] is None]
        if not todo:
            return True
        e = self.e
        # the idle cache first: under a limit it is what makes room (checked before it, a plan installed where
        # the warm-up's cache sat was refused its pages, served beside the arena and dropped, and a replay that
        # fits unmarked under its own peak ran out of memory: new user 12)
        e._empty_cache_locked()
        lim = e.limit_nbytes
        if lim is not None and e.backing.reserved_nbytes + self.mapped_nbytes + len(todo) * g > lim:
            return False
        # runs of at most the engine's chunk cap (Note [Arena runs of at most a chunk])
        cap = e.policy.chunk_cap_pages((e.backing.reserved_nbytes + self.mapped_nbytes) // g, g)
        runs: list[list[int]] = []
        for p in todo:
            if runs and runs[-1][1] == p and p - runs[-1][0] < cap:
                runs[-1][1] = p + 1
            else:
                runs.append([p, p + 1])
        dev = e.device
        for a, b in runs:
            va, nb = arena.base + a * g, (b - a) * g
            try:
                handle = dev.mem_create(nb)
            except OutOfMemoryError:
                return False
            try:
                dev.mem_map(va, nb, handle, 0)
            except BaseException:
                _quietly(dev.mem_release, handle)
                raise
            try:
                dev.mem_set_access(va, nb)
            except BaseException:
                try:
                    dev.mem_unmap(va, nb)
                except BaseException as undo:
                    # the mapping stays: kept as a run (no page of it serves) for the give-back to retry, and
                    # the plan is dropped at the next mark (Note [A mapping the arena could not undo]); a
                    # KeyboardInterrupt or SystemExit of the undo goes on, once booked
                    self._book_run(arena, va, nb, handle)
                    self.broken = True
                    if not isinstance(undo, Exception):
                        raise
                else:
                    _quietly(dev.mem_release, handle)
                raise
            self.counts["arena_calls"] += 3
            self._book_run(arena, va, nb, handle)
            for p in range(a, b):
                arena.pages[p] = handle
        return True

    def _book_run(self, arena: _Arena, va: int, nb: int, handle: Any) -> None:
        """A run mapped in ``arena``: held (counted in reserved, its peak, and against the limit) until given back."""
        arena.runs.append([va, nb, handle, False])
        arena.mapped_nbytes += nb
        self.mapped_nbytes += nb
        e = self.e
        e.backing.outside_nbytes = self.mapped_nbytes
        st = e._stats
        total = e.backing.reserved_nbytes + self.mapped_nbytes
        if total > st.peak_reserved_nbytes:
            st.peak_reserved_nbytes = total

    def free(self, ptr: int) -> bool:
        """A free of an arena pointer (True: done); False: the engine's pointer, recorded after the engine
        freed it (:meth:`record_free`)."""
        for arena in reversed(self.arenas):
            if arena.holds(ptr):
                entry = arena.live.pop(ptr, None)
                if entry is None:
                    raise InvalidPointerError(f"free of {ptr:#x}: no live allocation starts there in the step plan's arena")
                k, size, nbytes = entry
                if self.e._recorder is not None:   # the history holds the plan's frees too (record_history)
                    self.e._recorder.record_free(ptr, self.history_streams.pop(ptr, 0))
                if not arena.dropped and k >= 0 and not self.poisoned[k]:   # a slot used on another stream stays taken
                    self.occupied.remove(self.off[k])
                st = self.e._stats
                st.allocated_nbytes -= size
                st.requested_nbytes -= nbytes
                st.num_frees += 1
                if arena.dropped and not arena.live:
                    self._release(arena)
                return True
        return False

    def record_free(self, ptr: int) -> None:
        """Lifetimes: a recorded allocation freed (by the engine) now."""
        i = self.cur_map.pop(ptr, None)
        if i is not None:
            self.cur[i][2] = len(self.cur)
            return
        i = self.prev_map.pop(ptr, None)
        if i is not None:
            self.prev[i][3] = len(self.cur)

    def record_cross_stream(self, ptr: int) -> None:
        """The engine's live ``ptr`` is used on a stream other than its own (``record_stream``): a recorded
        step it belongs to is not planned (Note [Step plans and record_stream])."""
        if ptr in self.cur_map:
            self.cur_cross = True
        elif ptr in self.prev_map:
            self.prev_cross = True

    def arena_entry(self, ptr: int) -> tuple[_Arena, tuple[int, int, int]] | None:
        """``(arena, (slot, size, requested))`` of a live arena pointer; None outside every arena.

        Raises:
            InvalidPointerError: inside an arena, where no live allocation starts.
        """
        for arena in reversed(self.arenas):
            if arena.holds(ptr):
                entry = arena.live.get(ptr)
                if entry is None:
                    raise InvalidPointerError(f"{ptr:#x} is not a live allocation (inside the step plan's arena)")
                return arena, entry
        return None

    def record_stream(self, ptr: int, stream: int) -> bool:
        """True when ``ptr`` is the arena's: its slot stays taken after its free (no event orders its next
        occupant after ``stream``'s work) until the plan is dropped, and the arena waits for ``stream``."""
        found = self.arena_entry(ptr)
        if found is None:
            return False
        arena, (k, _, _) = found
        if arena.dropped or k < 0:   # a dropped arena's, or a kept block no slot meets any more
            arena.streams.add(stream)
        elif stream != self.stream[k]:
            arena.streams.add(stream)
            self.poisoned[k] = True
        return True

    # -- dropping ----------------------------------------------------------------------------------------
    def _drop(self) -> None:
        arena = self.arenas[-1]
        arena.dropped = True
        self.counts["plans_dropped"] += 1
        self._clear_slots()

    def holds_memory(self) -> bool:
        """Whether :meth:`shrink` has anything to drop or give back: a plan installed, or an arena still held."""
        return self.state is StepState.PLANNED or bool(self.arenas)

    def shrink(self) -> None:
        """The engine is out of memory (its retry ladder): drop the plan, give back every dropped arena with
        nothing live and, of the others, every run no live allocation touches (Note [Step plans under memory
        pressure])."""
        if self.state is StepState.PLANNED:
            self._drop()
            self._reset_recording()
            self.state = StepState.RECORDING
        self._give_back_dropped()

    def give_back_idle(self) -> int:
        """``empty_cache``: give back every run of every arena, the current plan's too, that no live allocation
        touches (after the arena's streams), and every dropped arena with nothing live; the bytes given back
        (Note [When marks stop]). The plan stays: its slots map their pages again when they next serve."""
        before = self.mapped_nbytes
        self._give_back_dropped()
        if self.state is StepState.PLANNED:
            self._give_back_idle_runs(self.arenas[-1])
        return before - self.mapped_nbytes

    def _give_back_idle_runs(self, arena: _Arena) -> None:
        """Give back the runs of ``arena`` that no live allocation touches, after the arena's streams."""
        idle = [i for i, (va, nb, _, _) in enumerate(arena.runs)
                if not any(ptr < va + nb and va < ptr + size for ptr, (_, size, _) in arena.live.items())]
        if not idle:
            return
        dev = self.e.device
        for st in sorted(arena.streams):
            dev.stream_synchronize(st)
        for i in reversed(idle):
            self._give_back_run(arena, i)

    def _give_back_dropped(self) -> None:
        """Gives back every dropped arena with nothing live and, of the others, every run no live allocation
        touches (after the arena's streams are done)."""
        for arena in [a for a in self.arenas if a.dropped]:
            if not arena.live:
                self._release(arena)
                continue
            self._give_back_idle_runs(arena)

    def _give_back_run(self, arena: _Arena, i: int) -> None:
        """Unmap (unless a failed try already did) and release run ``i`` of ``arena``, then forget it: a
        failure leaves the run with what was done marked, so the next try goes on from there."""
        dev = self.e.device
        run = arena.runs[i]
        va, nb, handle, unmapped = run
        if not unmapped:
            dev.mem_unmap(va, nb)
            run[3] = True
            self.counts["arena_calls"] += 1
            # unmapped now: a slot that touches these pages maps them again, even if the release below fails
            # (its pages read as mapped served unmapped memory: review attacker 12, F2); the bytes stay held
            # (mapped_nbytes) until the release
            g = arena.g
            for p in range((va - arena.base) // g, (va - arena.base + nb) // g):
                arena.pages[p] = None
        dev.mem_release(handle)
        self.counts["arena_calls"] += 1
        del arena.runs[i]
        arena.mapped_nbytes -= nb
        self.mapped_nbytes -= nb
        self.e.backing.outside_nbytes = self.mapped_nbytes

    def _release(self, arena: _Arena) -> None:
        """Wait for the arena's streams, then unmap, release and free it; a failure keeps what is left
        of it, each run marked unmapped once it is, so the next try (a mark, ``close``) goes on from there."""
        dev = self.e.device
        for s in sorted(arena.streams):
            dev.stream_synchronize(s)
        while arena.runs:
            self._give_back_run(arena, len(arena.runs) - 1)
        dev.address_free(arena.base, arena.nbytes)
        self.counts["arena_calls"] += 1
        self.arenas.remove(arena)
        self.released.append((arena.base, arena.nbytes))
        if len(self.released) > RELEASED_ARENAS:
            del self.released[0]

    def released_arena(self, ptr: int) -> tuple[int, int] | None:
        """``(base, nbytes)`` of the newest arena given back that held ``ptr``, of the last
        :data:`RELEASED_ARENAS` (error path only).

        Note [Frees into a given-back arena]: a dropped arena goes back once nothing in it is live, so a
        later free of a pointer inside it is a second free of an arena allocation (or a pointer into one)
        that the engine's bookkeeping never held: it said "which this allocator did not allocate", hiding
        that the pointer came from the step plan. The last few arenas' ranges (a bounded list: bytes, no
        growth over a run) let the free name the arena. The range may have been reserved again since: a
        new arena's pointers go through the plan layer first, and the engine (``_free_engine``) asks only
        for pointers outside its own ranges, so the message never names an arena for memory that is the
        engine's now; an arena older than the list gets the plain message."""
        for base, nbytes in reversed(self.released):
            if base <= ptr < base + nbytes:
                return base, nbytes
        return None

    def close(self) -> None:
        """Give every arena back (the engine's ``close``)."""
        for arena in list(self.arenas):
            arena.dropped = True
            arena.live.clear()
            self._release(arena)
        self.state = StepState.OFF
        self._reset_recording()
        self._clear_slots()

    def info(self) -> PlanInfo:
        arena = self._current()
        c = self.counts
        return PlanInfo((int(self.state), len(self.off), arena.extent_nbytes if arena else 0, self.mapped_nbytes,
                         c["served"], c["fallback"], c["steps_hit"], c["steps_missed"], c["plans_installed"],
                         c["plans_dropped"], c["arena_calls"], self.live_nbytes(), len(self.cur) + len(self.prev),
                         c["recordings_abandoned"], c["implicit_steps"],
                         int(self.e.backing.warmup and self.e._stats.num_allocs - self.warmup_since < WARMUP_ALLOCS)))

    def live_nbytes(self) -> int:
        """Bytes (rounded) of live arena allocations, for the consistency check."""
        return sum(size for a in self.arenas for (_, size, _) in a.live.values())

    def live_count(self) -> int:
        """Live allocations in every arena, the current plan's and dropped ones' (``num_live_blocks``: Note
        [The step plan's arena in the summary] in :mod:`.stats`)."""
        return sum(len(a.live) for a in self.arenas)


def _check_slots(planned: list[tuple[int, int]], sizes: list[int], e1: list[int], e2: list[int]) -> None:
    """Raise :class:`InvalidArgumentError` when two planned slots alive together overlap in the arena: a sweep
    over the step's ranks (a slot lives over ``[k, e1)`` and, when ``e2``, ``[0, e2)``; frees before
    allocations at one rank) keeps the live slots' ranges, which must stay disjoint: O(n log n), where a
    check of every pair was quadratic for slots that share an offset. The native engine's install runs the
    same sweep (the same pair named)."""
    events = []
    for o, k in planned:
        events.append((k, 1, k))
        events.append((e1[k], 0, k))
        if e2[k]:
            events.append((0, 1, k))
            events.append((e2[k], 0, k))
    events.sort()
    offs = dict((k, o) for o, k in planned)
    alive = _Ranges()
    for _, starts, k in events:
        o = offs[k]
        if not starts:
            alive.remove(o)
            continue
        j = alive.meeting(o, o + sizes[k])
        if j >= 0:
            raise InvalidArgumentError(f"install_plan: slots {min(j, k)} and {max(j, k)} are alive together and "
                                       "overlap in the arena")
        alive.add(o, o + sizes[k], k)


def _refused_slots(planned: list[tuple[int, int]], sizes: list[int], streams: list[int], n: int) -> list[bool]:
    """Per slot, whether its range in the arena meets a slot of another stream (refused: no event orders one
    stream's use after the other's). ``planned``: (offset, slot) sorted. A slot meets an earlier-sorted one
    of another stream when that one ends past its start (the two largest ends of distinct streams so far),
    a later-sorted one when that one starts before its end (the next position of another stream)."""
    refused = [False] * n
    m = len(planned)
    starts = [o for o, _ in planned]
    st = [streams[k] for _, k in planned]
    best_end, best_stream, other_end = -1, None, -1   # the largest end so far, its stream; the largest of others
    for i, (o, k) in enumerate(planned):
        s, end = st[i], o + sizes[k]
        if (best_end if best_stream != s else other_end) > o:
            refused[k] = True
        if s == best_stream:
            best_end = max(best_end, end)
        elif end > best_end:
            best_end, best_stream, other_end = end, s, best_end
        else:
            other_end = max(other_end, end)
    next_other = [m] * m   # the first position after i whose stream is not st[i]
    for i in range(m - 2, -1, -1):
        next_other[i] = i + 1 if st[i + 1] != st[i] else next_other[i + 1]
    for i, (o, k) in enumerate(planned):
        if next_other[i] < bisect.bisect_left(starts, o + sizes[k]):
            refused[k] = True
    return refused


def check_early_leave_steps(steps: Any) -> int:
    """``steps`` as an early-leave bound (Note [A plan that leaves early]): an int in [0, 2**40]."""
    return check_int_in_range(steps, "early_leave_steps", 0, 1 << 40)


def check_record_limit(records: Any) -> int:
    """``set_step_record_limit``'s ``records``: an int in [1, 2**40] (:class:`InvalidArgumentError`)."""
    n = as_int(records, "records")
    if not 1 <= n <= 1 << 40:
        raise InvalidArgumentError(f"set_step_record_limit: records must be in [1, 2**40], got {n}")
    return n


def check_generation(generation: Any) -> int | None:
    """``install_plan``'s ``generation``: None or an int in [0, 2**63) (:class:`InvalidArgumentError`)."""
    if generation is None:
        return None
    g = as_int(generation, "generation")
    if not 0 <= g < 1 << 63:
        raise InvalidArgumentError(f"install_plan: generation must be in [0, 2**63), got {g}")
    return g


def _quietly(call: Any, *args: Any) -> None:
    """Undo a step of a failed mapping: an ordinary failure of the undo is dropped (the first failure is
    what propagates); a KeyboardInterrupt or SystemExit is not (Note [Only Exception is caught] in
    ``gpumem/_native/engine.cpp``)."""
    try:
        call(*args)
    except Exception:  # noqa: BLE001
        pass
