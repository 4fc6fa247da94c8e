// The C++ half of the simulated `neuron` device (tests/accel/simulated_neuron.py): what torch only asks a
// PrivateUse1 backend for in C++. Python cannot provide these (torch._C._acc's Python hooks stop at
// is_available/is_built/has_primary_context), so without them `torch.Generator("neuron")`, `pin_memory()`,
// `UntypedStorage.resize_` (FSDP2), `torch.accelerator.synchronize()/memory_*` and a check on `neuron:1` fail.
// Device memory stays host memory owned by Python: allocation, resize and the memory counters call back into
// the Python module handed to `install`, so both halves share one memory model.
#include <ATen/EmptyTensor.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>

namespace py = pybind11;

namespace {

constexpr auto kNeuron = c10::DeviceType::PrivateUse1;
py::object* g_py = nullptr;  // the Python module: _cpp_alloc, _cpp_resize, _cpp_stats, reset_peak_memory_stats

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK_INDEX(index <= 0, "neuron:", int(index), " does not exist: this process sees 1 neuron device (neuron:0)");
}

// The RNG of a neuron device, shaped like an accelerator's counter-based (Philox) generator: its state is 16 bytes,
// (seed, offset), which DTensor's OffsetBasedRNGTracker reads and moves. Random ops run on host views with a CPU
// generator seeded from (seed, offset), and then advance the offset (Python fallback).
struct NeuronGenerator final : c10::GeneratorImpl {
  uint64_t seed_, offset_ = 0;
  explicit NeuronGenerator(uint64_t seed)
      : c10::GeneratorImpl({kNeuron, 0}, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)), seed_(seed) {}
  void set_current_seed(uint64_t seed) override { seed_ = seed, offset_ = 0; }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override {
    set_current_seed(c10::detail::getNonDeterministicRandom());
    return seed_;
  }
  void set_offset(uint64_t offset) override { offset_ = offset; }
  uint64_t get_offset() const override { return offset_; }
  void set_state(const c10::TensorImpl& state) override {
    TORCH_CHECK(state.numel() * state.itemsize() == 16, "a neuron RNG state is 16 bytes: seed, offset");
    std::memcpy(&seed_, state.data(), 8);
    std::memcpy(&offset_, static_cast<const char*>(state.data()) + 8, 8);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto state = at::detail::empty_cpu({16}, at::kByte, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
    std::memcpy(state.data_ptr(), &seed_, 8);
    std::memcpy(static_cast<char*>(state.data_ptr()) + 8, &offset_, 8);
    return state.getIntrusivePtr();
  }

 private:
  NeuronGenerator* clone_impl() const override {
    auto* copy = new NeuronGenerator(seed_);
    copy->offset_ = offset_;
    return copy;
  }
};

// Pinned host memory is plain host memory whose ranges are remembered, so that is_pinned() can answer.
struct PinnedAllocator final : c10::Allocator {
  static std::mutex mu;
  static std::map<const char*, size_t> live;  // start -> bytes
  static void release(void* p) {
    { std::lock_guard<std::mutex> lock(mu); live.erase(static_cast<const char*>(p)); }
    c10::free_cpu(p);
  }
  static bool contains(const void* p) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = live.upper_bound(static_cast<const char*>(p));
    if (it == live.begin()) return false;
    --it;
    return static_cast<const char*>(p) < it->first + std::max<size_t>(it->second, 1);
  }
  c10::DataPtr allocate(size_t n) override {
    void* p = c10::alloc_cpu(n);
    { std::lock_guard<std::mutex> lock(mu); live[static_cast<const char*>(p)] = n; }
    return {p, p, &release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dst, const void* src, size_t n) const override { std::memcpy(dst, src, n); }
};
std::mutex PinnedAllocator::mu;
std::map<const char*, size_t> PinnedAllocator::live;
PinnedAllocator g_pinned;

struct NeuronHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex index) const override { check_index(index); return true; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    check_index(index);
    static at::Generator g = at::make_generator<NeuronGenerator>(c10::default_rng_seed_val);
    return g;
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    check_index(index);
    return at::make_generator<NeuronGenerator>(c10::default_rng_seed_val);
  }
  at::Device getDeviceFromPtr(void*) const override { return {kNeuron, 0}; }
  bool isPinnedPtr(const void* p) const override { return PinnedAllocator::contains(p); }
  at::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned; }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    py::gil_scoped_acquire gil;
    auto obj = py::reinterpret_steal<py::object>(THPStorage_Wrap(storage));
    g_py->attr("_cpp_resize")(obj, nbytes);
  }
};

// One device, one stream, host-synchronous: events are complete once recorded, waits return at once.
struct NeuronGuard final : c10::impl::DeviceGuardImplInterface {
  static thread_local c10::StreamId current_stream;
  static std::atomic<c10::StreamId> next_stream;
  c10::DeviceType type() const override { return kNeuron; }
  c10::Device exchangeDevice(c10::Device d) const override { check_index(d.index()); return {kNeuron, 0}; }
  c10::Device getDevice() const override { return {kNeuron, 0}; }
  void setDevice(c10::Device d) const override { check_index(d.index()); }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const override { return c10::Stream(c10::Stream::UNSAFE, {kNeuron, 0}, current_stream); }
  c10::Stream getDefaultStream(c10::Device) const override { return c10::Stream(c10::Stream::DEFAULT, {kNeuron, 0}); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getNewStream(d, 0); }
  c10::Stream getNewStream(c10::Device d, int) const override {
    check_index(d.index());
    return c10::Stream(c10::Stream::UNSAFE, {kNeuron, 0}, next_stream++);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    c10::Stream previous = getStream(s.device());
    current_stream = s.id();
    return previous;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    *event = reinterpret_cast<void*>(1);  // any non-null handle: the work it marks is already done
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex index) const override { check_index(index); }
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};
thread_local c10::StreamId NeuronGuard::current_stream = 0;
std::atomic<c10::StreamId> NeuronGuard::next_stream{1};

// The allocator torch.accelerator.memory_* and C++ allocations (UntypedStorage(n, device="neuron")) reach:
// host buffers from Python (`_cpp_alloc`), freed with the GIL, counted by the Python module.
struct NeuronAllocator final : c10::DeviceAllocator {
  static void release(void* ctx) {
    if (!Py_IsInitialized()) return;  // interpreter shutting down: the process frees it
    py::gil_scoped_acquire gil;
    delete static_cast<py::object*>(ctx);
  }
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return {nullptr, c10::Device(kNeuron, 0)};
    py::gil_scoped_acquire gil;
    auto* buffer = new py::object(g_py->attr("_cpp_alloc")(n));
    void* ptr = reinterpret_cast<void*>(buffer->attr("data_ptr")().cast<uintptr_t>());
    return {ptr, buffer, &release, c10::Device(kNeuron, 0)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dst, const void* src, size_t n) const override { std::memcpy(dst, src, n); }
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}
  void recordStream(const c10::DataPtr&, c10::Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex index) override {
    check_index(index);
    py::gil_scoped_acquire gil;
    auto s = g_py->attr("_cpp_stats")().cast<std::tuple<int64_t, int64_t, int64_t, int64_t>>();
    c10::CachingDeviceAllocator::DeviceStats stats;
    for (auto* array : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes, &stats.requested_bytes}) {
      auto& stat = (*array)[static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE)];
      std::tie(stat.current, stat.peak, stat.allocated, stat.freed) = s;
    }
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex) override {}
  void resetPeakStats(c10::DeviceIndex) override {
    py::gil_scoped_acquire gil;
    g_py->attr("reset_peak_memory_stats")();
  }
};

void install(py::object module) {
  if (g_py != nullptr) return;
  g_py = new py::object(std::move(module));  // leaked on purpose: lives as long as the process
  at::RegisterPrivateUse1HooksInterface(new NeuronHooks());
  static c10::impl::DeviceGuardImplRegistrar guard(kNeuron, new NeuronGuard());  // torch 2.9 has no registerDeviceGuard
  static NeuronAllocator allocator;
  c10::SetAllocator(kNeuron, &allocator, /*priority=*/1);
}

py::object default_generator() {
  const at::Generator& g = at::detail::getPrivateUse1Hooks().getDefaultGenerator(0);
  return py::reinterpret_steal<py::object>(THPGenerator_initDefaultGenerator(g));
}

void make_resizable(py::handle storage) {
  // UntypedStorage.resize_ reaches resizePrivateUse1Bytes only for a resizable storage, which needs an allocator.
  c10::StorageImpl* impl = THPStorage_Unpack(storage.ptr()).unsafeGetStorageImpl();
  impl->set_allocator(c10::GetAllocator(kNeuron));
  impl->set_resizable(true);
}

at::Tensor empty_tensor(const at::Tensor& like) {
  // torch._C._acc.create_empty_tensor, which torch 2.9 does not have: an empty neuron tensor of `like`'s dtype
  return at::detail::empty_generic({0}, c10::GetAllocator(kNeuron), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   like.scalar_type(), std::nullopt);
}

void swap_storage(py::handle a, py::handle b) {
  // UntypedStorage._swap_data_ptr_, which torch 2.9 does not have: the two storages trade memory and sizes
  c10::StorageImpl* x = THPStorage_Unpack(a.ptr()).unsafeGetStorageImpl();
  c10::StorageImpl* y = THPStorage_Unpack(b.ptr()).unsafeGetStorageImpl();
  size_t x_bytes = x->nbytes(), y_bytes = y->nbytes();
  c10::DataPtr x_data = x->set_data_ptr(y->set_data_ptr(c10::DataPtr()));
  y->set_data_ptr_noswap(std::move(x_data));
  x->set_nbytes(y_bytes);
  y->set_nbytes(x_bytes);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install, "register the neuron hooks, device guard and allocator (once per process)");
  m.def("default_generator", &default_generator, "the default neuron generator");
  m.def("make_resizable", &make_resizable, "let storage resize_ reach the resize hook");
  m.def("empty_tensor", &empty_tensor, "an empty neuron tensor of a tensor's dtype");
  m.def("swap_storage", &swap_storage, "two storages trade their memory and sizes");
}
