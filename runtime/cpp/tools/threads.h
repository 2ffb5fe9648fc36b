// aotgen-run's and aotgen-batch's warning when --threads outnumber the CPUs the process may
// use, as `aotgen run` prints it: oversubscribed threads wait on each other, and decode slows
// severalfold.
#pragma once

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <string>

#include <ATen/Parallel.h>

// The affinity mask's CPUs, capped by a cgroup v2 CPU quota (a container's `--cpus`).
inline int usable_cpus() {
  cpu_set_t set;
  int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  std::ifstream quota_file("/sys/fs/cgroup/cpu.max");
  std::string quota;
  double period = 0;
  if (quota_file >> quota >> period && quota != "max" && period > 0) {
    try {
      cpus = std::min(cpus, std::max(1, (int)std::ceil(std::stod(quota) / period)));
    } catch (const std::exception&) {
    }
  }
  return std::max(cpus, 1);
}

// threads: --threads, or 0 for torch's default.
inline void warn_if_oversubscribed(int threads) {
  const int count = threads > 0 ? threads : at::get_num_threads();
  const int cpus = usable_cpus();
  if (count <= cpus) return;
  std::cerr << "warning: "
            << (threads > 0 ? "--threads " + std::to_string(count)
                            : "torch's default of " + std::to_string(count) + " threads")
            << " on " << cpus << " usable CPU" << (cpus > 1 ? "s" : "")
            << ": the threads wait on each other and decode slows severalfold; use --threads "
            << cpus << " or fewer\n";
}
