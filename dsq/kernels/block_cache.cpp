/* A CPU allocator for torch that keeps freed large blocks for reuse by the next block of the same
 * size (dsq/kernels/block_cache.py builds this file and installs it; dsq_cli/cpu_allocator.py's
 * `reuse` setting asks for it).
 *
 * Why: a training step frees and allocates blocks of the same few sizes many times over (the
 * tiles of dsq's attention, the slices of an MLP, the quantizers' outputs). Where glibc gives a
 * large block back to the system when it is freed (DSQ_CPU_ALLOCATOR=release), each such block
 * is faulted in afresh, page by page, at every use; where glibc keeps freed memory in its heap
 * (keep), blocks of differing sizes fragment it and the process holds several times what its
 * tensors hold. This cache sits between: a freed block whose size lies in [smallest, largest] is
 * kept, up to `capacity` bytes in all, the least recently freed given back first, and handed to
 * the next allocation of exactly its size. Every block of every size is served here (torch's
 * `c10::alloc_cpu` and `free_cpu`, as its default CPU allocator does), so one deleter frees them
 * all; a block the allocator before this one handed out (before the install) goes back through
 * that allocator's raw deleter.
 *
 * The process holds its tensors and at most `capacity` bytes besides. (Keeping blocks only while
 * live and kept stay within the most ever live at once, which would leave the process's peak
 * its tensors', was measured: it gives back what is kept just where a checkpointed step spends
 * most of its time, near its peak, and the held Llama row's step took 1.27x as long;
 * docs/benchmarks.md, "The held row by CPU allocator setting".)
 *
 * Every block is reported to torch's profiler as the default allocator reports its own
 * (allocated when handed out, freed when its tensor frees it, whether or not it is then kept),
 * so the allocator's peak that `dsq bench memory` replays from the profiler's records counts
 * tensors only, as before.
 */
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <pthread.h>

#include <cstring>
#include <list>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

class BlockCache final : public c10::Allocator {
  public:
    BlockCache(c10::Allocator *before, size_t smallest, size_t largest, size_t capacity)
        : before_(before), smallest_(smallest), largest_(largest), capacity_(capacity) {}

    c10::DataPtr allocate(size_t n) override {
        void *p = n == 0 ? nullptr : take(n);
        if (p == nullptr && n != 0) {
            p = c10::alloc_cpu(n);
        }
        try {
            std::lock_guard<std::mutex> guard(mutex_);
            if (p != nullptr) {
                live_[p] = n;
            }
        } catch (...) {  // the map could not grow: nothing is recorded, the block goes back
            c10::free_cpu(p);
            throw;
        }
        if (p != nullptr) {
            c10::profiledCPUMemoryReporter().New(p, n);
        }
        return {p, p, &BlockCache::release, c10::Device(c10::DeviceType::CPU)};
    }

    c10::DeleterFnPtr raw_deleter() const override { return &BlockCache::release; }

    void copy_data(void *dest, const void *src, std::size_t count) const override {
        default_copy_data(dest, src, count);
    }

    /* {bytes kept now, most bytes kept at once, allocations served from the cache, allocations
     * of a size it keeps that found none kept} */
    std::vector<int64_t> stats() {
        std::lock_guard<std::mutex> guard(mutex_);
        return {static_cast<int64_t>(kept_), static_cast<int64_t>(most_kept_), hits_, misses_};
    }

    bool same_settings(size_t smallest, size_t largest, size_t capacity) const {
        return smallest == smallest_ && largest == largest_ && capacity == capacity_;
    }

    static BlockCache *installed;

    /* pthread_atfork's handlers: a child forked while another thread held the lock (a data
     * loader's worker) would otherwise wait on it forever at its first allocation */
    static void before_fork() { installed->mutex_.lock(); }
    static void after_fork() { installed->mutex_.unlock(); }

  private:
    using Order = std::list<std::pair<size_t, void *>>;  // kept blocks, most recently freed first

    bool kept_size(size_t n) const { return smallest_ <= n && n <= largest_ && n <= capacity_; }

    void *take(size_t n) {
        if (!kept_size(n)) {
            return nullptr;
        }
        std::lock_guard<std::mutex> guard(mutex_);
        auto found = by_size_.find(n);
        if (found == by_size_.end() || found->second.empty()) {
            ++misses_;
            return nullptr;
        }
        auto where = found->second.back();  // the most recently freed of this size
        found->second.pop_back();
        void *p = where->second;
        order_.erase(where);
        kept_ -= n;
        ++hits_;
        return p;
    }

    /* The least recently freed kept blocks moved to `given_back` until at most `most` bytes
     * stay kept (the caller holds the lock, and frees them after releasing it). */
    void give_back_until(size_t most, std::vector<void *> &given_back) {
        while (kept_ > most) {
            auto oldest = std::prev(order_.end());
            auto &same = by_size_[oldest->first];
            for (auto it = same.begin(); it != same.end(); ++it) {
                if (*it == oldest) {
                    same.erase(it);
                    break;
                }
            }
            kept_ -= oldest->first;
            given_back.push_back(oldest->second);
            order_.erase(oldest);
        }
    }

    static void free_all(const std::vector<void *> &blocks) {
        for (void *block : blocks) {  // outside the lock: munmap may take a while
            c10::free_cpu(block);
        }
    }

    /* The deleter of every block handed out here, and the raw deleter (`raw_deallocate`) of
     * every block of this allocator. A block it did not hand out (the allocator before it gave
     * it, before the install, and it was raw-allocated there) goes back through that
     * allocator's raw deleter. */
    static void release(void *p) {
        if (p == nullptr) {
            return;
        }
        BlockCache *cache = installed;
        std::vector<void *> given_back;
        {
            std::unique_lock<std::mutex> guard(cache->mutex_);
            auto live = cache->live_.find(p);
            if (live == cache->live_.end()) {
                guard.unlock();
                c10::DeleterFnPtr before = cache->before_->raw_deleter();
                TORCH_CHECK(before != nullptr, "dsq's CPU block cache: torch's CPU allocator "
                            "before it has no raw deleter for a block it gave");
                before(p);
                return;
            }
            // under the lock: the block cannot be handed out again before its free is recorded
            c10::profiledCPUMemoryReporter().Delete(p);
            size_t n = live->second;
            cache->live_.erase(live);
            bool kept = false;
            if (cache->kept_size(n)) {
                try {
                    cache->order_.emplace_front(n, p);
                    try {
                        cache->by_size_[n].push_back(cache->order_.begin());
                    } catch (...) {
                        cache->order_.pop_front();
                        throw;
                    }
                    cache->kept_ += n;
                    kept = true;
                } catch (...) {  // no room to note it: the block goes back instead
                }
            }
            if (kept) {  // the least recently freed go back until the kept fit the capacity
                cache->give_back_until(cache->capacity_, given_back);
                if (cache->kept_ > cache->most_kept_) {
                    cache->most_kept_ = cache->kept_;
                }
            } else {
                given_back.push_back(p);
            }
        }
        free_all(given_back);
    }

    c10::Allocator *before_;
    const size_t smallest_, largest_, capacity_;
    std::mutex mutex_;
    std::unordered_map<void *, size_t> live_;  // blocks handed out here, by their size
    Order order_;
    std::unordered_map<size_t, std::vector<Order::iterator>> by_size_;
    size_t kept_ = 0, most_kept_ = 0;
    int64_t hits_ = 0, misses_ = 0;
};

BlockCache *BlockCache::installed = nullptr;

/* Install the cache as torch's CPU allocator for the rest of the process (never removed: blocks
 * it handed out may outlive any later setting). A second call with the same settings does
 * nothing; with other settings it is an error. */
void install(int64_t smallest, int64_t largest, int64_t capacity) {
    TORCH_CHECK_VALUE(0 < smallest && smallest <= largest && 0 <= capacity,
                      "dsq::cpu_block_cache_install needs 0 < smallest <= largest and capacity "
                      ">= 0, got ", smallest, ", ", largest, ", ", capacity);
    static std::mutex installing;
    std::lock_guard<std::mutex> guard(installing);
    auto s = static_cast<size_t>(smallest), l = static_cast<size_t>(largest),
         c = static_cast<size_t>(capacity);
    if (BlockCache::installed != nullptr) {
        TORCH_CHECK_VALUE(BlockCache::installed->same_settings(s, l, c),
                          "dsq's CPU block cache is installed already, with other settings");
        return;
    }
    // never freed: tensors it handed out are freed through it until the process ends
    auto *cache = new BlockCache(c10::GetCPUAllocator(), s, l, c);
    BlockCache::installed = cache;  // the fork handlers read it
    if (pthread_atfork(&BlockCache::before_fork, &BlockCache::after_fork,
                       &BlockCache::after_fork) != 0) {
        BlockCache::installed = nullptr;
        delete cache;
        TORCH_CHECK(false, "dsq's CPU block cache could not register its fork handlers");
    }
    c10::SetCPUAllocator(cache, /*priority=*/100);
}

std::vector<int64_t> stats() {
    if (BlockCache::installed == nullptr) {
        return {};
    }
    return BlockCache::installed->stats();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsq, m) {
    m.def("cpu_block_cache_install(int smallest, int largest, int capacity) -> ()", &install);
    m.def("cpu_block_cache_stats() -> int[]", &stats);
}
