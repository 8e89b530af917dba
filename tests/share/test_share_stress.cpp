// 10,000 random operations across processes, one of them killed midway, and
// the same mix across threads (run under ThreadSanitizer, label tsan): the
// pool's free counts return to their start values.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <deque>
#include <fstream>
#include <mutex>
#include <thread>

#include "random_ops.hpp"

namespace qkvshare {
namespace {

using testing::OpsPeer;
using testing::PoolName;
using testing::RandomOps;

ShareConfig stress_config() {
  ShareConfig c = testing::small_config(std::size_t{48} << 20);
  c.block_tokens = 8;
  c.max_tokens = 256;
  return c;
}

KvShape stress_shape() { return KvShape{2, 4, 2, 32}; }

// Appends each descriptor to a file (one write of 256 bytes each).
struct LogFile {
  int fd;
  void operator()(const Descriptor& d) const {
    const DescriptorBytes b = d.encode();
    if (::write(fd, b.data(), b.size()) != static_cast<ssize_t>(b.size())) std::abort();
  }
};

std::vector<Descriptor> read_log(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<Descriptor> out;
  DescriptorBytes b;
  while (in.read(reinterpret_cast<char*>(b.data()), static_cast<std::streamsize>(b.size()))) {
    try {
      out.push_back(Descriptor::decode(b));
    } catch (const Error&) {
    }
  }
  return out;
}

TEST(ShareStress, TenThousandOperationsAcrossProcessesWithAKilledOne) {
  PoolName name("stress");
  auto pool = SharePool::create(name.name, stress_config());
  const auto kv = pool->kv_pool(stress_shape());
  const PoolCounters start = kv->counters();
  const std::string dir = testing::temp_dir();
  // A ring of three processes: i sends to (i + 1) % 3 through a pipe.
  int pipes[3][2];
  for (auto& p : pipes) {
    ASSERT_EQ(::pipe2(p, O_NONBLOCK), 0);
  }
  const auto worker = [&](int i, int ops) {
    return [&, i, ops] {
      auto p = SharePool::attach(name.name);
      const int log = ::open((dir + "/log" + std::to_string(i)).c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
      OpsPeer peer;
      peer.me = "p" + std::to_string(i);
      peer.peer = "p" + std::to_string((i + 1) % 3);
      peer.send = [&pipes, i](const Descriptor& d) {
        const DescriptorBytes b = d.encode();
        return ::write(pipes[(i + 1) % 3][1], b.data(), b.size()) == static_cast<ssize_t>(b.size());
      };
      peer.receive = [&pipes, i]() -> std::optional<Descriptor> {
        DescriptorBytes b;
        if (::read(pipes[i][0], b.data(), b.size()) != static_cast<ssize_t>(b.size())) return std::nullopt;
        return Descriptor::decode(b);
      };
      peer.log = LogFile{log};
      RandomOps r(*p, stress_shape(), peer, 1000u + static_cast<unsigned>(i));
      const testing::OpsCounts c = r.run(ops);
      r.finish();
      std::fprintf(stderr, "p%d: %d ops, %d seals, %d grants, %d opens, %d forks, %d releases, %d revokes, %d refused\n",
                   i, c.ops, c.seals, c.grants, c.opens, c.forks, c.releases, c.revokes, c.refused);
      return c.seals > 0 && c.opens > 0 ? 0 : 4;
    };
  };
  const pid_t victim = testing::spawn(worker(2, -1));  // runs until killed
  const pid_t a = testing::spawn(worker(0, 5000));
  const pid_t b = testing::spawn(worker(1, 5000));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  EXPECT_EQ(testing::wait_exit(victim), 128 + SIGKILL);
  EXPECT_EQ(testing::wait_exit(a), 0);
  EXPECT_EQ(testing::wait_exit(b), 0);
  pool->reap();
  // Grants in flight to the killed process (or never read): the orchestrator
  // (here the test) releases what it routed; stale ones are refused.
  int released = 0;
  for (int i = 0; i < 3; ++i)
    for (const Descriptor& d : read_log(dir + "/log" + std::to_string(i))) {
      try {
        pool->release(d, d.grantee);
        ++released;
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::bad_descriptor) << e.what();
      }
    }
  for (auto& p : pipes) {
    ::close(p[0]);
    ::close(p[1]);
  }
  const ShareStats st = pool->stats();
  std::fprintf(stderr, "released %d leftover grants; reaped %llu processes, %llu references\n", released,
               static_cast<unsigned long long>(st.counters.processes_reaped),
               static_cast<unsigned long long>(st.counters.references_reaped));
  EXPECT_EQ(st.contexts, 0);
  EXPECT_EQ(st.grants, 0);
  EXPECT_EQ(st.processes, 1);
  EXPECT_EQ(kv->counters().blocks_free, start.blocks_free);
  EXPECT_EQ(kv->counters().pages_free, start.pages_free);
}

constexpr int kThreads = 6;

// In-process mailboxes between threads.
struct Mailboxes {
  std::mutex mutex;
  std::vector<std::deque<Descriptor>> boxes;
  std::vector<Descriptor> log;
};

TEST(ShareThreads, ConcurrentSealForkReleaseKeepsThePoolConsistent) {
  auto pool = SharePool::create_anonymous(stress_config());
  const auto kv = pool->kv_pool(stress_shape());
  const PoolCounters start = kv->counters();
  Mailboxes mail;
  mail.boxes.resize(kThreads);
  std::vector<std::thread> threads;
  std::vector<int> ok(kThreads, 0);
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&, i] {
      OpsPeer peer;
      peer.me = "t" + std::to_string(i);
      peer.peer = "t" + std::to_string((i + 1) % kThreads);
      peer.send = [&mail, i](const Descriptor& d) {
        std::lock_guard g(mail.mutex);
        mail.boxes[static_cast<std::size_t>((i + 1) % kThreads)].push_back(d);
        return true;
      };
      peer.receive = [&mail, i]() -> std::optional<Descriptor> {
        std::lock_guard g(mail.mutex);
        auto& box = mail.boxes[static_cast<std::size_t>(i)];
        if (box.empty()) return std::nullopt;
        Descriptor d = box.front();
        box.pop_front();
        return d;
      };
      peer.log = [&mail](const Descriptor& d) {
        std::lock_guard g(mail.mutex);
        mail.log.push_back(d);
      };
      RandomOps r(*pool, stress_shape(), peer, 77u + static_cast<unsigned>(i));
      const auto c = r.run(600);
      r.finish();
      ok[static_cast<std::size_t>(i)] = c.seals > 0 && c.opens > 0;
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) EXPECT_TRUE(ok[static_cast<std::size_t>(i)]) << i;
  for (const Descriptor& d : mail.log) {
    try {
      pool->release(d, d.grantee);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::bad_descriptor);
    }
  }
  const ShareStats st = pool->stats();
  EXPECT_EQ(st.contexts, 0);
  EXPECT_EQ(st.grants, 0);
  EXPECT_EQ(kv->counters().blocks_free, start.blocks_free);
  EXPECT_EQ(kv->counters().pages_free, start.pages_free);
}

}  // namespace
}  // namespace qkvshare
