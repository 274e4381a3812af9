// The one recorder of PyTorch's allocations on gpumem (torch_api.cpp): the history `gpumem record`
// reads and the per-device trace GPUMEM_TRACE_OUT writes are two windows onto its one event list.
// No CUDA and no Python here (tests/pytorch/test_recorder.py builds it alone).
//
// Note [One recorder for the history and the trace]: the hooks record each allocation, free and
// out-of-memory error once (one mutex, one push) whichever output is on; both off, they pay one relaxed
// load. The history (Note [Allocation history for gpumem record]) takes every device's events up to
// its max_entries and counts the rest as dropped, never wrapping around, so that every recorded free
// still has its alloc; the trace (Note [Tracing PyTorch's calls]) takes allocs and frees without bound
// and is read one device at a time. Each window is turned on (emptied, its clock restarted) and off
// (kept for reading) on its own. While either is on, an event is stored if a window takes it, so each
// window's events lie together in the list: the history's are the first `taken` from its start (once
// full it takes no more until restarted), the trace's those from its start to its stop (less the
// out-of-memory events, which only the history takes). Restarting a window drops from the front of the
// list the events that no window reads any more. A hook reads the clock before it takes the lock, so
// an event's time may precede the one recorded ahead of it or a window's start (turned on by another
// thread in between): it is raised to the latest of those, keeping times in list order and never before
// their window (a trace time of 2**64 less a little, a negative history time). Stream uses
// (record_stream, kStreamUse) and stream waits (wait_stream, kStreamWait) go to the trace only (kinds 2
// and 3 there: a gpumem trace's StreamUse and StreamWait), and so do step-plan events (kPlanEvent: a step
// mark, the warm-up begun or stopped, its PlanEventKind in the bytes word; kind 4 there: a PlanEvent); the
// history, which PyTorch's snapshot format reads, neither takes nor counts them, and skips them when read.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <new>
#include <vector>

namespace gpumem {

// One event as gpumem_torch_history hands it out.
struct HistoryEvent {          // mirrored by gpumem/recording.py (_HistoryEvent)
    std::uint64_t addr;
    std::uint64_t nbytes;
    std::uint64_t stream;
    double time_us;            // since the history was turned on
    std::int32_t device;
    std::int32_t action;       // 0 alloc, 1 free, 2 out of memory (addr 0, nbytes requested); never 3
};

class Recorder {
  public:
    static constexpr std::int32_t kAlloc = 0, kFree = 1, kOutOfMemory = 2, kStreamUse = 3, kStreamWait = 4,
                                  kPlanEvent = 5;
    // Words per event gpumem_torch_trace_read writes: kind (0 alloc, 1 free, 2 stream use: record_stream
    // of the allocation at the address on the stream, bytes 0; 3 stream wait: the stream waits for the
    // stream in the address word, bytes 0; 4 a step-plan event, its PlanEventKind in the bytes word), address,
    // bytes, stream, nanoseconds since the trace was turned on.
    static constexpr std::size_t kTraceWords = 5;
    static constexpr std::uint64_t kTraceUseKind = 2, kTraceWaitKind = 3, kTracePlanKind = 4;

    // Whether `action` is the trace's only (the history neither takes nor counts it).
    static bool trace_only(std::int32_t action) {
        return action == kStreamUse || action == kStreamWait || action == kPlanEvent;
    }

    // Whether a window is on (the hooks' one check when both are off).
    bool on() const { return any_on_.load(std::memory_order_relaxed); }

    // Records one event at `t_ns` (steady clock). `nbytes` of a free is PyTorch's size as given (the
    // history keeps it as is, the trace reads a negative one as 0). Never throws: an event that cannot
    // be stored is counted as dropped by the history.
    // `gpu_stamp`: the event's stamp of the trace's GPU clock (torch_api.cpp), -1 for none; `reserved`: the
    // engine's reserved bytes once the op was made (Note [The live engine's reserve] in torch_api.cpp), -1 for none.
    void record(std::int32_t action, int device, std::uint64_t addr, std::uint64_t nbytes, std::uint64_t stream,
                std::int64_t t_ns, std::int64_t gpu_stamp = -1, std::int64_t reserved = -1) noexcept {
        std::lock_guard<std::mutex> lock(mutex_);
        const bool history_kind = !trace_only(action);
        const bool to_history = history_.on && history_kind && taken_ < max_entries_;
        const bool to_trace = trace_.on && action != kOutOfMemory;
        if (history_.on && history_kind && !to_history) ++dropped_;
        if (!to_history && !to_trace) return;
        if (t_ns < last_ns_) t_ns = last_ns_;
        try {
            events_.push_back(
                Event{addr, nbytes, stream, t_ns, static_cast<std::int32_t>(device), action, gpu_stamp, reserved});
        } catch (const std::bad_alloc&) {   // recording never fails an allocation: the event is dropped
            if (to_history) ++dropped_;
            return;
        }
        if (to_history) ++taken_;
        last_ns_ = t_ns;
    }

    // Turns the history on, emptied, for up to `max_entries` (> 0) events from `t0_ns`; throws
    // std::bad_alloc (nothing changed) when the first room cannot be reserved.
    void history_start(std::uint64_t max_entries, std::int64_t t0_ns) {
        std::lock_guard<std::mutex> lock(mutex_);
        events_.reserve(events_.size() + static_cast<std::size_t>(std::min<std::uint64_t>(max_entries, 1u << 16)));
        history_ = Window{true, events_.size(), 0, t0_ns};
        max_entries_ = max_entries;
        taken_ = 0;
        dropped_ = 0;
        if (t0_ns > last_ns_) last_ns_ = t0_ns;
        compact();
        any_on_.store(true, std::memory_order_relaxed);
    }

    void history_stop() {
        std::lock_guard<std::mutex> lock(mutex_);
        history_.on = false;
        any_on_.store(trace_.on, std::memory_order_relaxed);
    }

    // Copies up to `n` history events into `out` (nullptr: none); *dropped (if given) gets the events
    // past max_entries. Returns how many events the history holds.
    std::int64_t history_read(HistoryEvent* out, std::int64_t n, std::uint64_t* dropped) {
        std::lock_guard<std::mutex> lock(mutex_);
        const std::int64_t held = static_cast<std::int64_t>(taken_);
        if (out != nullptr) {
            const std::int64_t k = std::min(n, held);
            std::int64_t i = 0;
            for (std::size_t j = history_.start; i < k && j < events_.size(); ++j) {
                const Event& e = events_[j];
                if (trace_only(e.action)) continue;
                out[i++] = HistoryEvent{e.addr, e.nbytes, e.stream, static_cast<double>(e.t_ns - history_.t0_ns) / 1000.0,
                                        e.device, e.action};
            }
        }
        if (dropped != nullptr) *dropped = dropped_;
        return held;
    }

    // Turns the trace on, emptied, with its clock at `t0_ns`.
    void trace_start(std::int64_t t0_ns) {
        std::lock_guard<std::mutex> lock(mutex_);
        trace_ = Window{true, events_.size(), 0, t0_ns};
        if (t0_ns > last_ns_) last_ns_ = t0_ns;
        compact();
        any_on_.store(true, std::memory_order_relaxed);
    }

    void trace_stop() {
        std::lock_guard<std::mutex> lock(mutex_);
        if (trace_.on) trace_.stop = events_.size();
        trace_.on = false;
        any_on_.store(history_.on, std::memory_order_relaxed);
    }

    // Copies up to `n` of `device`'s trace events into `out` (kTraceWords words each); returns how many
    // the trace holds for that device.
    std::int64_t trace_read(int device, std::uint64_t* out, std::int64_t n) {
        std::lock_guard<std::mutex> lock(mutex_);
        return each_trace_event(device, out != nullptr ? n : 0, [&](const Event& e, std::int64_t k) {
            const std::uint64_t nbytes = static_cast<std::int64_t>(e.nbytes) < 0 ? 0 : e.nbytes;
            const std::uint64_t kind = e.action == kStreamUse    ? kTraceUseKind
                                       : e.action == kStreamWait ? kTraceWaitKind
                                       : e.action == kPlanEvent  ? kTracePlanKind
                                                                 : static_cast<std::uint64_t>(e.action);
            const std::uint64_t words[kTraceWords] = {kind, e.addr, nbytes, e.stream,
                                                      static_cast<std::uint64_t>(e.t_ns - trace_.t0_ns)};
            std::memcpy(out + static_cast<std::size_t>(k) * kTraceWords, words, sizeof words);
        });
    }

    // For each of `device`'s trace events (those trace_read copies, in its order), up to `n` into `out`: the
    // time on the trace's clock (ns since it began) of the event's GPU stamp in `stamp_ns` (steady-clock ns by
    // stamp index, the stamp's low 32 bits; -1 unknown), -1 where the event has none or one of another
    // `generation` (the high 32 bits: a stamp of an earlier trace). Returns how many the trace holds there.
    std::int64_t trace_read_gpu(int device, const std::vector<std::int64_t>& stamp_ns, std::uint32_t generation,
                                std::int64_t* out, std::int64_t n) {
        std::lock_guard<std::mutex> lock(mutex_);
        return each_trace_event(device, out != nullptr ? n : 0, [&](const Event& e, std::int64_t k) {
            const std::uint64_t stamp = static_cast<std::uint64_t>(e.gpu_stamp);
            const std::size_t index = static_cast<std::size_t>(stamp & 0xffffffffu);
            const bool known = e.gpu_stamp >= 0 && (stamp >> 32) == generation && index < stamp_ns.size() &&
                               stamp_ns[index] >= 0;
            out[k] = known ? stamp_ns[index] - trace_.t0_ns : -1;
        });
    }

    // For each of `device`'s trace events (those trace_read copies, in its order), up to `n` into `out`: the
    // engine's reserved bytes once the event's op was made, -1 where not recorded (frees, stream uses and waits,
    // plan events). Returns how many the trace holds there.
    std::int64_t trace_read_reserved(int device, std::int64_t* out, std::int64_t n) {
        std::lock_guard<std::mutex> lock(mutex_);
        return each_trace_event(device, out != nullptr ? n : 0,
                                [&](const Event& e, std::int64_t k) { out[k] = e.reserved; });
    }

  private:
    struct Event {
        std::uint64_t addr;
        std::uint64_t nbytes;
        std::uint64_t stream;
        std::int64_t t_ns;
        std::int32_t device;
        std::int32_t action;
        std::int64_t gpu_stamp;   // the trace's GPU clock (torch_api.cpp), -1 for none
        std::int64_t reserved;    // the engine's reserved bytes after the op (Note [The live engine's reserve]), -1
    };
    struct Window {
        bool on = false;
        std::size_t start = 0;   // index of its first event in events_
        std::size_t stop = 0;    // the trace's end once turned off
        std::int64_t t0_ns = 0;
    };

    // Calls fn(event, k) for the first `n` of `device`'s trace events (the k-th of them), in order; returns how
    // many the trace holds for that device (under mutex_). Out-of-memory events are the history's only.
    template <typename Fn>
    std::int64_t each_trace_event(int device, std::int64_t n, Fn&& fn) {
        const std::size_t end = trace_.on ? events_.size() : trace_.stop;
        std::int64_t have = 0;
        for (std::size_t i = trace_.start; i < end; ++i) {
            const Event& e = events_[i];
            if (e.device != device || e.action == kOutOfMemory) continue;
            if (have < n) fn(e, have);
            ++have;
        }
        return have;
    }

    // Drops the events before the first one a window still reads (under mutex_).
    void compact() {
        const std::size_t history_end = history_.start + static_cast<std::size_t>(taken_);
        const std::size_t trace_end = trace_.on ? events_.size() : trace_.stop;
        std::size_t first = events_.size();
        if (history_.on || history_end > history_.start) first = std::min(first, history_.start);
        if (trace_.on || trace_end > trace_.start) first = std::min(first, trace_.start);
        if (first == 0) return;
        events_.erase(events_.begin(), events_.begin() + static_cast<std::ptrdiff_t>(first));
        history_.start = history_.start > first ? history_.start - first : 0;
        trace_.start = trace_.start > first ? trace_.start - first : 0;
        trace_.stop = trace_.stop > first ? trace_.stop - first : 0;
    }

    std::mutex mutex_;
    std::atomic<bool> any_on_{false};
    std::vector<Event> events_;   // every member below is guarded by mutex_
    Window history_;
    Window trace_;
    std::uint64_t max_entries_ = 0;
    std::uint64_t taken_ = 0;
    std::uint64_t dropped_ = 0;
    std::int64_t last_ns_ = INT64_MIN;   // the latest event's time or window start (Note above)
};

}  // namespace gpumem
