// Checks gpumem/_native/recorder.h alone (tests/pytorch/test_recorder.py builds and runs it): the one
// recorder must hand out what the two recorders it replaced did, the history (bounded, every device)
// and the per-device trace, over random sequences of events and of windows turned on and off.
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "recorder.h"

using gpumem::HistoryEvent;
using gpumem::Recorder;

namespace {

int failures = 0;

#define CHECK(cond, ...)                                                \
    do {                                                                \
        if (!(cond)) {                                                  \
            std::printf("FAIL line %d: %s: ", __LINE__, #cond);         \
            std::printf(__VA_ARGS__);                                   \
            std::printf("\n");                                          \
            if (++failures > 20) std::exit(1);                          \
        }                                                               \
    } while (0)

// The two recorders torch_api.cpp had before: a bounded history of every device, and per device a
// trace of allocs and frees.
struct TwoRecorders {
    bool history_on = false;
    std::uint64_t max_entries = 0, dropped = 0;
    std::int64_t history_t0 = 0;
    std::vector<HistoryEvent> history;
    bool trace_on = false;
    std::int64_t trace_t0 = 0;
    std::vector<std::uint64_t> trace[3];

    void record(std::int32_t action, int device, std::uint64_t addr, std::uint64_t nbytes, std::uint64_t stream,
                std::int64_t t) {
        if (history_on && action != Recorder::kStreamUse && action != Recorder::kStreamWait &&
            action != Recorder::kPlanEvent) {   // the trace's only
            if (history.size() >= max_entries) ++dropped;
            else history.push_back(HistoryEvent{addr, nbytes, stream, static_cast<double>(t - history_t0) / 1000.0,
                                                device, action});
        }
        if (trace_on && action != Recorder::kOutOfMemory) {
            const std::uint64_t n = static_cast<std::int64_t>(nbytes) < 0 ? 0 : nbytes;
            const std::uint64_t kind = action == Recorder::kStreamUse    ? 2
                                       : action == Recorder::kStreamWait ? 3
                                       : action == Recorder::kPlanEvent  ? 4
                                                                         : static_cast<std::uint64_t>(action);
            trace[device].insert(trace[device].end(), {kind, addr, n, stream,
                                                       static_cast<std::uint64_t>(t - trace_t0)});
        }
    }
};

void compare(Recorder& one, const TwoRecorders& two, int seed, int step) {
    std::uint64_t dropped = 0;
    const std::int64_t held = one.history_read(nullptr, 0, &dropped);
    CHECK(held == static_cast<std::int64_t>(two.history.size()), "seed %d step %d: history holds %" PRId64
          " events, expected %zu", seed, step, held, two.history.size());
    CHECK(dropped == two.dropped, "seed %d step %d: dropped %" PRIu64 ", expected %" PRIu64, seed, step, dropped,
          two.dropped);
    std::vector<HistoryEvent> got(two.history.size() + 1);
    const std::int64_t n = one.history_read(got.data(), static_cast<std::int64_t>(two.history.size()), nullptr);
    for (std::size_t i = 0; i < two.history.size() && static_cast<std::int64_t>(i) < n; ++i) {
        const HistoryEvent& a = got[i];
        const HistoryEvent& b = two.history[i];
        CHECK(a.addr == b.addr && a.nbytes == b.nbytes && a.stream == b.stream && a.time_us == b.time_us &&
              a.device == b.device && a.action == b.action, "seed %d step %d: history event %zu differs", seed, step, i);
    }
    for (int d = 0; d < 3; ++d) {
        const std::int64_t have = one.trace_read(d, nullptr, 0);
        const std::int64_t want = static_cast<std::int64_t>(two.trace[d].size() / Recorder::kTraceWords);
        CHECK(have == want, "seed %d step %d device %d: trace holds %" PRId64 ", expected %" PRId64, seed, step, d,
              have, want);
        std::vector<std::uint64_t> words(two.trace[d].size() + Recorder::kTraceWords, 7);
        const std::int64_t part = want / 2;   // a short read copies only what it was asked for
        one.trace_read(d, words.data(), part);
        for (std::size_t i = 0; i < static_cast<std::size_t>(part) * Recorder::kTraceWords; ++i)
            CHECK(words[i] == two.trace[d][i], "seed %d step %d device %d: trace word %zu differs", seed, step, d, i);
        CHECK(words[static_cast<std::size_t>(part) * Recorder::kTraceWords] == 7,
              "seed %d step %d: a read of %" PRId64 " events wrote past them", seed, step, part);
    }
}

// A hook reads the clock before it takes the recorder's lock, so a window turned on by another thread
// in between starts after the event's time (review rv21a): the event must not lie before its window (a
// negative history time; a trace time of 2**64 less a little) nor before the event recorded ahead of it.
void check_events_timed_before_their_window() {
    Recorder r;
    r.trace_start(5000);
    r.history_start(10, 5000);
    r.record(Recorder::kAlloc, 0, 1 << 21, 512, 0, 4000);   // its clock was read before both starts
    r.record(Recorder::kFree, 0, 1 << 21, 512, 0, 7000);
    r.record(Recorder::kAlloc, 0, 2 << 21, 512, 0, 6000);   // read before the free's, recorded after it
    HistoryEvent h[3];
    CHECK(r.history_read(h, 3, nullptr) == 3, "three history events");
    CHECK(h[0].time_us == 0.0 && h[1].time_us == 2.0 && h[2].time_us == 2.0, "history times %g %g %g",
          h[0].time_us, h[1].time_us, h[2].time_us);
    std::uint64_t w[3 * Recorder::kTraceWords];
    CHECK(r.trace_read(0, w, 3) == 3, "three trace events");
    CHECK(w[4] == 0 && w[9] == 2000 && w[14] == 2000, "trace times %" PRIu64 " %" PRIu64 " %" PRIu64, w[4], w[9],
          w[14]);
}

}  // namespace

int main() {
    check_events_timed_before_their_window();
    for (int seed = 0; seed < 400; ++seed) {
        std::mt19937_64 rng(static_cast<std::uint64_t>(seed));
        Recorder one;
        TwoRecorders two;
        std::int64_t t = 1000000;
        for (int step = 0; step < 300; ++step) {
            t += static_cast<std::int64_t>(rng() % 5000);
            const unsigned op = static_cast<unsigned>(rng() % 100);
            if (op < 4) {
                const std::uint64_t max_entries = 1 + rng() % 40;
                one.history_start(max_entries, t);
                two.history_on = true;
                two.max_entries = max_entries;
                two.dropped = 0;
                two.history.clear();
                two.history_t0 = t;
            } else if (op < 6) {
                one.history_stop();
                two.history_on = false;
            } else if (op < 10) {
                one.trace_start(t);
                two.trace_on = true;
                two.trace_t0 = t;
                for (auto& v : two.trace) v.clear();
            } else if (op < 12) {
                one.trace_stop();
                two.trace_on = false;
            } else {
                const unsigned pick = static_cast<unsigned>(rng() % 11);
                const std::int32_t action = pick == 0 ? Recorder::kOutOfMemory
                                            : pick == 1 ? Recorder::kStreamUse
                                            : pick == 2 ? Recorder::kStreamWait
                                            : pick == 3 ? Recorder::kPlanEvent : static_cast<std::int32_t>(rng() % 2);
                const int device = static_cast<int>(rng() % 3);
                std::uint64_t nbytes = 1 + rng() % (1u << 30);
                if (action == Recorder::kFree && rng() % 8 == 0) nbytes = static_cast<std::uint64_t>(-1);   // size < 0
                if (action == Recorder::kStreamUse || action == Recorder::kStreamWait) nbytes = 0;
                if (action == Recorder::kPlanEvent) nbytes = rng() % 3;   // a PlanEventKind
                const std::uint64_t addr = action == Recorder::kOutOfMemory ? 0 : (rng() % 4096) << 21;
                const std::uint64_t stream = rng() % 3;
                CHECK(one.on() == (two.history_on || two.trace_on), "seed %d step %d: on() is wrong", seed, step);
                if (one.on()) one.record(action, device, addr, nbytes, stream, t);
                two.record(action, device, addr, nbytes, stream, t);
            }
            if (step % 7 == 0 || step == 299) compare(one, two, seed, step);
        }
    }
    if (failures) return 1;
    std::printf("ok\n");
    return 0;
}
