/* A wall-clock stack sampler for one thread, for the benches: a per-thread timer sends SIGPROF
 * to the thread every interval and the handler stores backtrace() into a buffer allocated up
 * front (nothing is allocated in the handler). bench/native_sampler.py builds this file with
 * the machine's C compiler, resolves the addresses and prints where the thread spent its time;
 * the GPU machine has no perf, gdb or py-spy, and torch's profiler does not see MLX's C++.
 * backtrace() is not async-signal-safe: the unwinder takes the loader's lock, so a thread
 * sampled inside dlopen could deadlock. Sample a thread in its steady state, in a bench. */
#define _GNU_SOURCE
#include <errno.h>
#include <execinfo.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef sigev_notify_thread_id
#define sigev_notify_thread_id _sigev_un._tid
#endif

static void **frames;
static int *depths;
static int max_samples, max_depth;
static volatile int taken;
static timer_t timer;
static int armed;
/* Samples are kept only while the gate is open (sampler_gate): a bench can sample one phase
 * of the thread's work, such as a prefill's lead-in, over many repeats. */
static volatile int gate = 1;

static void on_prof(int sig, siginfo_t *info, void *context) {
  (void)sig; (void)info; (void)context;
  int i = taken;
  if (i >= max_samples || !gate) return;
  int saved = errno;
  depths[i] = backtrace(frames + (size_t)i * max_depth, max_depth);
  taken = i + 1;
  errno = saved;
}

/* 0 on success, else the errno of the call that failed. */
int sampler_start(int tid, int interval_us, int samples, int depth) {
  if (armed || samples <= 0 || depth <= 0 || interval_us <= 0) return EINVAL;
  frames = calloc((size_t)samples * depth, sizeof(void *));
  depths = calloc((size_t)samples, sizeof(int));
  if (!frames || !depths) return ENOMEM;
  max_samples = samples;
  max_depth = depth;
  taken = 0;
  gate = 1;
  void *warm[4];
  backtrace(warm, 4); /* loads the unwinder now, not inside the first signal */

  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_prof;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  if (sigaction(SIGPROF, &sa, NULL) != 0) return errno;

  struct sigevent ev;
  memset(&ev, 0, sizeof ev);
  ev.sigev_notify = SIGEV_THREAD_ID;
  ev.sigev_signo = SIGPROF;
  ev.sigev_notify_thread_id = tid;
  if (timer_create(CLOCK_MONOTONIC, &ev, &timer) != 0) return errno;
  struct itimerspec spec;
  spec.it_interval.tv_sec = interval_us / 1000000;
  spec.it_interval.tv_nsec = (long)(interval_us % 1000000) * 1000;
  spec.it_value = spec.it_interval;
  if (timer_settime(timer, 0, &spec, NULL) != 0) {
    int err = errno;
    timer_delete(timer);
    return err;
  }
  armed = 1;
  return 0;
}

void sampler_gate(int open) { gate = open; }

/* Stops the timer; returns the number of samples taken. */
int sampler_stop(void) {
  if (armed) {
    timer_delete(timer);
    armed = 0;
  }
  return taken;
}

int sampler_depth(int i) { return (i >= 0 && i < taken) ? depths[i] : 0; }

void *sampler_frame(int i, int j) {
  return (i >= 0 && i < taken && j >= 0 && j < depths[i]) ? frames[(size_t)i * max_depth + j] : NULL;
}
