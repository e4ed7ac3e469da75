/* Where tensors' data is, read from their TensorImpls: the address part of the CPU graphs' per-step
 * model check (csrc/model_check.c, minivllm/engine/model_check.py).
 *
 * A CPU graph's recorded calls hold the raw addresses of the weights they read, so before every
 * replay the check asks whether each parameter still has its data where it had (a learner's
 * `param.data = ...`, module.to(), set_() move it). Through Python that is one Tensor.data_ptr()
 * call per tensor, ~85 ns each: for the embedded model's 35 tensors ~3 us, a tenth of the engine's
 * stubbed batch-1 step. Here the answer is read from each tensor's TensorImpl (torch's own header,
 * c10/core/TensorImpl.h: this file is built against the installed torch, keyed by its version).
 *
 * A hold takes a weak reference to each TensorImpl: its memory stays valid while held, but a strong
 * reference would have changed what torch sees (torch.utils.swap_tensors refuses a tensor whose
 * TensorImpl has other owners). The check then reads, for each, whether it is still alive, the
 * Python object it belongs to (swap_tensors moves TensorImpls between Python objects) and where its
 * data is. Everything runs with the GIL held.
 * Part of minivllm; built at first use with a C++ compiler; without one the check calls
 * Tensor.data_ptr through Python. */
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <cstdlib>

namespace {

struct Held {
    int64_t n;
    c10::TensorImpl **impls;
    const void **owners;  /* each TensorImpl's Python object when held (compared by address only) */
    const void **addrs;   /* each tensor's data_ptr() when held */
};

}  // namespace

extern "C" {

/* Holds n tensors: impls[i] a tensor's TensorImpl (its Python `_cdata`), owners[i] the tensor as a
 * Python object (its address), addrs[i] its data_ptr(). NULL when out of memory. The caller holds
 * the tensors while it calls this (each TensorImpl alive). */
void *tensor_data_hold(const int64_t *impls, const int64_t *owners, const int64_t *addrs, int64_t n) {
    Held *h = static_cast<Held *>(std::calloc(1, sizeof(Held)));
    if (!h)
        return nullptr;
    const size_t count = n > 0 ? static_cast<size_t>(n) : 1;
    h->impls = static_cast<c10::TensorImpl **>(std::calloc(count, sizeof(void *)));
    h->owners = static_cast<const void **>(std::calloc(count, sizeof(void *)));
    h->addrs = static_cast<const void **>(std::calloc(count, sizeof(void *)));
    if (!h->impls || !h->owners || !h->addrs) {
        std::free(h->impls);
        std::free(h->owners);
        std::free(h->addrs);
        std::free(h);
        return nullptr;
    }
    for (int64_t i = 0; i < n; i++) {
        h->impls[i] = reinterpret_cast<c10::TensorImpl *>(static_cast<intptr_t>(impls[i]));
        h->owners[i] = reinterpret_cast<const void *>(static_cast<intptr_t>(owners[i]));
        h->addrs[i] = reinterpret_cast<const void *>(static_cast<intptr_t>(addrs[i]));
        c10::raw::weak_intrusive_ptr::incref(h->impls[i]);
        h->n = i + 1;  /* what tensor_data_release gives back */
    }
    return h;
}

/* Gives back the weak references of tensor_data_hold and frees the hold (NULL: nothing). */
void tensor_data_release(void *held) {
    Held *h = static_cast<Held *>(held);
    if (!h)
        return;
    for (int64_t i = 0; i < h->n; i++)
        c10::raw::weak_intrusive_ptr::decref(h->impls[i]);
    std::free(h->impls);
    std::free(h->owners);
    std::free(h->addrs);
    std::free(h);
}

/* 1 when every held TensorImpl is alive, still belongs to the Python object it belonged to and has
 * its data at the held address; 0 when one does not, or reading it raised (the caller then asks
 * Python). With the GIL held no Python object's tensor is freed meanwhile. */
int tensor_data_unchanged(const void *held) noexcept {
    const Held *h = static_cast<const Held *>(held);
    if (!h)
        return 0;
    try {
        for (int64_t i = 0; i < h->n; i++) {
            c10::TensorImpl *t = h->impls[i];
            if (c10::raw::weak_intrusive_ptr::use_count(t) == 0  /* freed (its memory kept by the hold) */
                || static_cast<const void *>(t->pyobj_slot()->load_pyobj()) != h->owners[i] || t->data() != h->addrs[i])
                return 0;
        }
    } catch (...) {  /* data() of a tensor without storage */
        return 0;
    }
    return 1;
}

}  // extern "C"
