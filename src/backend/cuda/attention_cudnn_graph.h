// The cuDNN backend-graph pieces of attention_cudnn.cu: an owning descriptor, attribute
// setters that turn cuDNN failures into tessera::Error, a builder that collects an operation
// graph, and the forward / backward SDPA graphs themselves (attention_cudnn_graph.cu).
// Internal to the CUDA backend; only meaningful when the build has cuDNN.
#pragma once

#if TESSERA_WITH_CUDNN
#include <cudnn.h>

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::cuda::cudnn_graph {

// Throws Error naming the call, cuDNN's status and cudnnGetLastErrorString's message.
[[noreturn]] void fail_cudnn(const std::string& call, cudnnStatus_t status);
// The status and cuDNN's last error message, for logs.
std::string status_text(cudnnStatus_t status);
// TESSERA_CUDNN_VERBOSE is set (and not 0): print what is built.
bool verbose();

#define TESSERA_CUDNN_CHECK(call)                                                   \
  do {                                                                              \
    const cudnnStatus_t tessera_cudnn_status = (call);                              \
    if (tessera_cudnn_status != CUDNN_STATUS_SUCCESS)                               \
      ::tessera::cuda::cudnn_graph::fail_cudnn(#call, tessera_cudnn_status);        \
  } while (0)

// A backend descriptor, destroyed with its owner.
class Desc {
 public:
  Desc(cudnnBackendDescriptorType_t type, const char* what) {
    const cudnnStatus_t s = cudnnBackendCreateDescriptor(type, &d_);
    if (s != CUDNN_STATUS_SUCCESS) fail_cudnn(std::string("cudnnBackendCreateDescriptor(") + what + ")", s);
  }
  ~Desc() {
    if (d_) cudnnBackendDestroyDescriptor(d_);
  }
  Desc(Desc&& other) noexcept : d_(other.d_) { other.d_ = nullptr; }
  Desc& operator=(Desc&&) = delete;
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

void set_attr(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
              int64_t count, const void* value, const char* what);
#define SET_ATTR(desc, name, type, count, value) \
  ::tessera::cuda::cudnn_graph::set_attr(desc, name, type, count, value, #name)
void finalize(cudnnBackendDescriptor_t d, const char* what);

using Dims = std::array<int64_t, 4>;
using Raw = cudnnBackendDescriptor_t;

// Unique ids of the tensors the caller binds; virtual tensors count up from 1000.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kScale, kNegInf, kSeqQ, kSeqKV, kOne, kSoftmaxSum, kDQAccum, kUidCount
};
// Collects the descriptors of one operation graph, in creation order.
struct GraphBuilder {
  std::vector<Desc> keep;
  std::vector<Raw> ops;
  std::vector<int64_t> bound_uids;  // non-virtual tensors: what the variant pack must bind
  int64_t next_virtual = 1000;

  Raw add(Desc d) {
    keep.push_back(std::move(d));
    return keep.back().get();
  }

  Raw tensor(int64_t uid, cudnnDataType_t type, const Dims& dims, const Dims& strides, bool is_virtual,
             bool by_value = false) {
    Desc t(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor");
    const int64_t alignment = 16;
    SET_ATTR(t.get(), CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    SET_ATTR(t.get(), CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
    SET_ATTR(t.get(), CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
    SET_ATTR(t.get(), CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    SET_ATTR(t.get(), CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
    const bool yes = true;
    if (is_virtual) SET_ATTR(t.get(), CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &yes);
    if (by_value) SET_ATTR(t.get(), CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &yes);
    finalize(t.get(), "tensor");
    if (!is_virtual) bound_uids.push_back(uid);
    return add(std::move(t));
  }
  Raw virt(cudnnDataType_t type, const Dims& dims, const Dims& strides) {
    return tensor(next_virtual++, type, dims, strides, true);
  }
  // A scalar handed over by value (host pointer in the variant pack), broadcast to 4-D.
  Raw scalar(int64_t uid, cudnnDataType_t type) { return tensor(uid, type, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true); }

  void pointwise(cudnnPointwiseMode_t mode, Raw x, Raw b, Raw t, Raw y, cudnnDataType_t compute = CUDNN_DATA_FLOAT,
                 int64_t axis = -1) {
    Desc pw(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise");
    SET_ATTR(pw.get(), CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    SET_ATTR(pw.get(), CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &compute);
    if (mode == CUDNN_POINTWISE_GEN_INDEX) SET_ATTR(pw.get(), CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    finalize(pw.get(), "pointwise");
    const Raw pw_raw = add(std::move(pw));
    Desc op(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise operation");
    SET_ATTR(op.get(), CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw_raw);
    SET_ATTR(op.get(), CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    if (b) SET_ATTR(op.get(), CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    if (t) SET_ATTR(op.get(), CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t);
    SET_ATTR(op.get(), CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    const float one = 1.0f;
    SET_ATTR(op.get(), CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
    SET_ATTR(op.get(), CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
    finalize(op.get(), "pointwise operation");
    ops.push_back(add(std::move(op)));
  }

  void matmul(Raw a, Raw b, Raw c) {
    Desc mm(CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul");
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    SET_ATTR(mm.get(), CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
    finalize(mm.get(), "matmul");
    const Raw mm_raw = add(std::move(mm));
    Desc op(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul operation");
    SET_ATTR(op.get(), CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a);
    SET_ATTR(op.get(), CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    SET_ATTR(op.get(), CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c);
    SET_ATTR(op.get(), CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm_raw);
    finalize(op.get(), "matmul operation");
    ops.push_back(add(std::move(op)));
  }

  void reduction(cudnnReduceTensorOp_t mode, Raw x, Raw y) {
    Desc red(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction");
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    SET_ATTR(red.get(), CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
    SET_ATTR(red.get(), CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
    finalize(red.get(), "reduction");
    const Raw red_raw = add(std::move(red));
    Desc op(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction operation");
    SET_ATTR(op.get(), CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    SET_ATTR(op.get(), CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    SET_ATTR(op.get(), CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &red_raw);
    finalize(op.get(), "reduction operation");
    ops.push_back(add(std::move(op)));
  }

  // A new view of x's elements (here: a transpose expressed through strides).
  void reshape(Raw x, Raw y) {
    Desc op(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape operation");
    SET_ATTR(op.get(), CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    SET_ATTR(op.get(), CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    finalize(op.get(), "reshape operation");
    ops.push_back(add(std::move(op)));
  }
};

// The SDPA graphs for tessera's tensors (strides taken from them; see attention_cudnn.cu).
void build_forward(GraphBuilder& g, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                   const Tensor& lse, bool causal);
void build_backward(GraphBuilder& g, const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& out, const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                    bool causal);

}  // namespace tessera::cuda::cudnn_graph

#endif  // TESSERA_WITH_CUDNN
