// WorkRegion (trtllm_lite/ort_kernels/kernel_common.h) under contention, built and run by
// tests/test_work_region.py: a driver and a helper thread, phases whose batch counts go up and
// down; every item of every phase must run exactly once, within its phase. (The first version
// let the helper claim a batch past an old phase's end as the driver published a larger one:
// 800-1,200 bad items in 300,000 phases here, a segfault in SmolLM2 int4 decode steps.)
#include <cstdio>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kernel_common.h"

namespace trtllm_lite_kernels {
const OrtApi* g_api = nullptr;
thread_local const PartIO* g_part = nullptr;
thread_local WorkRegion* g_region = nullptr;
bool g_shape_reference = false;
}  // namespace trtllm_lite_kernels

using namespace trtllm_lite_kernels;

struct Job {
  unsigned phase;
  size_t total;
  std::atomic<unsigned>* runs;     // [total]: times each item ran
  std::atomic<unsigned>* wrong;    // items run with another phase's data
};
void item(void* user, size_t i) {
  Job& job = *static_cast<Job*>(user);
  if (i >= job.total) {
    job.wrong->fetch_add(1);
    return;
  }
  job.runs[i].fetch_add(1);
  for (volatile int spin = 0; spin < 50; ++spin) {
  }
}

int main(int argc, char** argv) {
  const long phases = argc > 1 ? atol(argv[1]) : 200000;
  std::vector<std::atomic<unsigned>> runs(64);
  std::atomic<unsigned> wrong{0};
  unsigned seed = 12345;
  long bad = 0, regions = 0;
  for (long p = 0; p < phases;) {
    WorkRegion region;
    std::thread helper([&] { region.help(); });
    for (int k = 0; k < 5000 && p < phases; ++k, ++p) {
      seed = seed * 1103515245u + 12345u;
      // alternate few and many batches: the helper meets a new phase with more batches than the last
      const size_t total = (p % 2 == 0) ? 2 : 3 + (seed >> 16) % 60;
      const size_t batches = (p % 4 == 1) ? 0 : (p % 4 == 3 ? 2 : total);
      for (size_t i = 0; i < total; ++i) runs[i].store(0);
      Job job{static_cast<unsigned>(p), total, runs.data(), &wrong};
      region.run(item, total, &job, batches);
      for (size_t i = 0; i < total; ++i)
        if (runs[i].load() != 1) ++bad;
    }
    region.finish();
    helper.join();
    ++regions;
  }
  // an item that throws, run by either thread: the driver's run() rethrows it once every batch
  // is done (the fused kernel turns it into its status), and the region goes on
  long thrown = 0, lost = 0;
  {
    WorkRegion region;
    std::thread helper([&] { region.help(); });
    struct Throwing {
      size_t bad_item;
      std::atomic<unsigned>* runs;
    };
    for (long p = 0; p < 2000; ++p) {
      const size_t total = 8;
      for (size_t i = 0; i < total; ++i) runs[i].store(0);
      Throwing job{static_cast<size_t>(p) % total, runs.data()};
      try {
        region.run([](void* user, size_t i) {
          Throwing& t = *static_cast<Throwing*>(user);
          t.runs[i].fetch_add(1);
          if (i == t.bad_item) throw std::runtime_error("item failed");
        }, total, &job, 0);
      } catch (const std::runtime_error& e) {
        thrown += std::string(e.what()) == "item failed";
      }
      for (size_t i = 0; i < total; ++i)   // the other batches still ran, once each
        if (runs[i].load() != 1) ++lost;
      Job plain{static_cast<unsigned>(p), total, runs.data(), &wrong};
      for (size_t i = 0; i < total; ++i) runs[i].store(0);
      region.run(item, total, &plain, 0);   // the next phase is whole
      for (size_t i = 0; i < total; ++i)
        if (runs[i].load() != 1) ++bad;
    }
    region.finish();
    helper.join();
  }
  // items run after their phase ended would show as runs != 1 in a later check or as `wrong`
  std::printf("phases %ld regions %ld bad %ld wrong %u thrown %ld/2000 lost %ld\n", phases, regions, bad,
              wrong.load(), thrown, lost);
  return bad == 0 && wrong.load() == 0 && thrown == 2000 && lost == 0 ? 0 : 1;
}
