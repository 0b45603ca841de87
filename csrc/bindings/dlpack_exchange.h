// dlpack_exchange.h: the parts of DLPack's C ABI (dlpack.h, version 1.x) that the tensor
// checks read, declared here because the extension builds without torch's headers.
//
// DLPack 1.3 adds a C "exchange API": a table of function pointers a framework puts on its
// tensor type as the capsule `__dlpack_c_exchange_api__` (torch.Tensor has it in the torch
// this project is built and tested with, 2.13; older ones fall back to the attribute
// reads). Its `dltensor_from_py_object_no_sync` fills a caller's DLTensor from a Python
// tensor in one C call, allocating nothing: address, device, dtype, shape and strides, the
// facts ringcoll otherwise reads with five Python attribute calls per tensor (about 0.3 us;
// tensor_checks.cpp). The layouts below are the ABI's, fixed for every 1.x version; a
// table whose major version is not 1 is not used.
#pragma once

#include <cstdint>

namespace ringcoll::bindings::dlpack {

enum DeviceType : int32_t { kDLCPU = 1 };

struct DLDevice {
  int32_t device_type;  // DeviceType
  int32_t device_id;
};

struct DLDataType {
  uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool
  uint8_t bits;
  uint16_t lanes;
};

struct DLTensor {
  void* data;  // torch: the data pointer itself (byte_offset 0)
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; never null from torch
  uint64_t byte_offset;
};

struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
};

struct ExchangeApiHeader {
  DLPackVersion version;
  ExchangeApiHeader* prev_api;
};

// Only the one entry used here is typed; the others keep their places in the table.
struct ExchangeApi {
  ExchangeApiHeader header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  // 0 and `out` filled, or -1 with a Python exception set. May be null.
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensor* out);
  void* current_work_stream;
};

constexpr const char* kCapsuleName = "dlpack_exchange_api";
constexpr uint32_t kMajorVersion = 1;

}  // namespace ringcoll::bindings::dlpack
