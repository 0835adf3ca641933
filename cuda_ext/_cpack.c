/* The compiled pack of a save that joins its scope's open group or is found in the index:
 * ``ssdtrain._cpack``.
 *
 * Note [a compiled pack for the common save] (``ssdtrain/engine/native.py`` has the whole Note)
 * The twin, in C, of ``SaveHooks._pack`` and of the join and hit cases of ``SaveHooks._pack_plain``
 * with ``group.join``, ``Group.add``, ``StorageIndex.find`` and ``add``, ``Counters.joined`` and
 * ``add``, ``CopyClock.produced`` and ``allows``, ``PeakRule.produced`` and ``Ref.__init__``: the same questions in the same
 * order, the same objects made with the same fields. Every question is asked before anything
 * changes; any answer other than "it joins" hands the save to the Python function that would
 * have decided it (``_pack_general`` or ``_pack_plain``), with nothing changed. A change to any of
 * those Python functions is a change here too (tests/test_pack_native.py compares the two paths'
 * states object by object). Pure C API, no torch headers: it builds wherever Python's headers are,
 * for any torch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <stdint.h>


#define NATIVE_ABI 4 /* hooks.py asks for this number: a stale build is not used */

/* Interned attribute names. */
#define NAMES(X) \
    X(layout) X(is_cuda) X(is_cpu) X(is_quantized) X(nbytes) X(_keep_depth) X(_closed) \
    X(_is_profiler_enabled) X(_base) X(_is_zerotensor) X(requires_grad) X(is_leaf) X(grad_fn) \
    X(__name__) X(capturing_now) X(untyped_storage) X(_cdata) X(_pinned) X(detach) \
    X(_pack_general) X(_pack_plain) X(_scopes) X(active) X(backward_started) X(stats_id) X(_tier) \
    X(_tier_cpu) X(_small_bytes) X(_graveyard) X(_writer) X(completed) X(_cache) X(late) X(small) \
    X(dead) X(lagging) X(_failures) X(pending) X(group) X(is_contiguous) X(storage_offset) \
    X(itemsize) X(element_size) X(shape) X(stride) X(_lock) X(acquire) X(release) X(index) X(keys) \
    X(extent) X(region) X(used) X(reserved) X(clock) X(_policy) X(when_full) X(closed) X(min_bytes) \
    X(_forked) X(inflight_bytes) X(_max_inflight) X(keep_from_layer) X(_layer_stack) X(_model) \
    X(producer_stream) X(parts) X(_group_saves) X(stream) X(device) X(pos) X(saves) X(_positions) \
    X(_ref_positions) X(limit) X(sent) X(host_cost) X(engine) X(_limit_at) X(ratio) X(tail) X(total) \
    X(_peak) X(start) X(_times) X(slab) X(offset) X(length) X(path_index) X(landed) X(due) X(back) \
    X(ordered) X(cdata) X(_weak_ref) X(entry) X(key) X(storage_ref) X(version) X(_version) X(data) \
    X(lo) X(guard) X(guard_weak) X(tainted) X(whole) X(refs) X(unpacked) X(_by_key) X(_counters) \
    X(joined) X(saved_bytes) X(unique_bytes) X(resident_bytes) X(op) X(graveyard) X(part) X(size) \
    X(dtype) X(conj) X(neg) X(gen) X(weak) X(filed) X(ref_weaks) X(is_complex) X(is_conj) X(is_neg) \
    X(_queue) X(pack_pumps) X(pump) X(_now) X(_op_now) X(join) X(_safe_point) X(raise_errors) X(add) X(state)

#define DECLARE(n) static PyObject *S_##n;
NAMES(DECLARE)

static struct {
    PyObject *Tensor, *Parameter, *strided, *Part, *Ref, *RefWeak, *StorageRef, *HostExtent;
    PyObject *profiler, *device, *hooks, *group_join, *inf, *to_copy, *empty, *expired, *kept, *queued;
    long long span_align, align, group_bytes;
    PyObject *owed, *counted;
    double due_margin;
    int ready;
} K;

/* Owned references, dropped together at the end. */
typedef struct { PyObject *o[256]; int n; } Own;
static inline PyObject *own(Own *w, PyObject *x) {
    if (x != NULL) { if (w->n == 256) Py_FatalError("ssdtrain._cpack: too many references"); w->o[w->n++] = x; }
    return x;
}
static void drop(Own *w) { while (w->n) { PyObject *x = w->o[--w->n]; Py_DECREF(x); } }

/* Note [a save's leaves are not the collector's] (``ssdtrain/engine/native.py`` has the whole Note)
 * Objects that hold no reference back to anything that could reach them: out of the cyclic
 * collector's lists, freed by their count as before. */
static inline void untrack(PyObject *o) {
    if (PyObject_GC_IsTracked(o)) PyObject_GC_UnTrack(o);
}

/* A shape or a stride: untracked where it holds plain ints only (a symbolic one holds objects). */
static void untrack_ints(PyObject *o) {
    if (!PyTuple_Check(o)) return;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); i++)
        if (!PyLong_CheckExact(PyTuple_GET_ITEM(o, i))) return;
    untrack(o);
}

#define GET(var, obj, name) do { if (!((var) = own(&w, PyObject_GetAttr((obj), S_##name)))) goto error; } while (0)
#define CALL0(var, obj, name) do { if (!((var) = own(&w, PyObject_CallMethodNoArgs((obj), S_##name)))) goto error; } while (0)
#define TRUTH(var, obj) do { if (((var) = PyObject_IsTrue(obj)) < 0) goto error; } while (0)
#define SET(obj, name, val) do { if (PyObject_SetAttr((obj), S_##name, (val)) < 0) goto error; } while (0)
#define LL(var, obj) do { (var) = PyLong_AsLongLong(obj); if ((var) == -1 && PyErr_Occurred()) goto error; } while (0)
#define NEWLL(var, v) do { if (!((var) = own(&w, PyLong_FromLongLong(v)))) goto error; } while (0)
#define SETLL(obj, name, v) do { PyObject *_v; NEWLL(_v, (v)); SET(obj, name, _v); } while (0)

static long long floor_mod(long long a, long long b) { long long m = a % b; return (m != 0 && ((m < 0) != (b < 0))) ? m + b : m; }
static long long floor_div(long long a, long long b) { return (a - floor_mod(a, b)) / b; }

/* A new instance of a Python class without its __init__ (the caller sets every field). */
static PyObject *bare(PyObject *cls) {
    PyTypeObject *tp = (PyTypeObject *)cls;
    PyObject *args = PyTuple_New(0);
    if (args == NULL) return NULL;
    PyObject *o = tp->tp_new(tp, args, NULL);
    Py_DECREF(args);
    return o;
}

static PyObject *configure(PyObject *mod, PyObject *kw) {
    if (!PyDict_Check(kw)) { PyErr_SetString(PyExc_TypeError, "configure takes a dict"); return NULL; }
#define TAKE(field, key) do { PyObject *v = PyDict_GetItemString(kw, key); \
        if (v == NULL) { PyErr_Format(PyExc_KeyError, "configure: %s", key); return NULL; } \
        Py_INCREF(v); Py_XSETREF(K.field, v); } while (0)
    TAKE(Tensor, "Tensor"); TAKE(Parameter, "Parameter"); TAKE(strided, "strided"); TAKE(Part, "Part");
    TAKE(Ref, "Ref"); TAKE(RefWeak, "RefWeak"); TAKE(StorageRef, "StorageRef"); TAKE(HostExtent, "HostExtent");
    TAKE(profiler, "profiler"); TAKE(device, "device"); TAKE(hooks, "hooks"); TAKE(group_join, "join");
    TAKE(owed, "OWED"); TAKE(counted, "COUNTED"); TAKE(expired, "expired"); TAKE(kept, "KEPT");
    TAKE(queued, "QUEUED");
#undef TAKE
    PyObject *v;
#define NUM(field, key, conv) do { v = PyDict_GetItemString(kw, key); \
        if (v == NULL) { PyErr_Format(PyExc_KeyError, "configure: %s", key); return NULL; } \
        K.field = conv(v); if (PyErr_Occurred()) return NULL; } while (0)
    NUM(span_align, "SPAN_ALIGN", PyLong_AsLongLong); NUM(align, "ALIGN", PyLong_AsLongLong);
    NUM(group_bytes, "GROUP_BYTES", PyLong_AsLongLong); NUM(due_margin, "DUE_MARGIN", PyFloat_AsDouble);
#undef NUM
    Py_XSETREF(K.inf, PyFloat_FromDouble(Py_HUGE_VAL));
    Py_XSETREF(K.to_copy, PyUnicode_InternFromString("ToCopyBackward0"));
    Py_XSETREF(K.empty, PyTuple_New(0));
    if (K.inf == NULL || K.to_copy == NULL || K.empty == NULL) return NULL;
    K.ready = 1;
    Py_RETURN_NONE;
}

/* ``x if x.is_leaf else x.detach()``: a parameter's save, as pack hands it back. */
static PyObject *leaf_or_detached(PyObject *t) {
    PyObject *leaf = PyObject_GetAttr(t, S_is_leaf);
    if (leaf == NULL) return NULL;
    int b = PyObject_IsTrue(leaf);
    Py_DECREF(leaf);
    if (b < 0) return NULL;
    if (b) { Py_INCREF(t); return t; }
    return PyObject_CallMethodNoArgs(t, S_detach);
}

/* PeakRule.produced(nbytes, hooks._now()) where the peak rule is active. 0, or -1 with an error. */
static int peak_produced(PyObject *peak, long long nbytes) {
    Own w;
    w.n = 0;
    PyObject *x, *y, *nowv, *start, *pos;
    int b, rc = -1;
    long long ppos;
    GET(x, peak, active); TRUTH(b, x);
    if (b) {
        PyObject *now = PyDict_GetItemWithError(K.hooks, S__now);
        if (now == NULL) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "hooks._now"); goto error; }
        if (!(nowv = own(&w, PyObject_CallNoArgs(now)))) goto error;
        GET(x, peak, pos); LL(ppos, x);
        NEWLL(pos, ppos + nbytes);
        SET(peak, pos, pos);
        GET(x, peak, _positions); if (PyList_Append(x, pos) < 0) goto error;
        GET(start, peak, start);
        if (!(y = own(&w, PyNumber_Subtract(nowv, start)))) goto error;
        GET(x, peak, _times); if (PyList_Append(x, y) < 0) goto error;
    }
    rc = 0;
error:
    drop(&w);
    return rc;
}

/* Ref(entry, t, graveyard, view_lo, whole, part): Ref.__init__'s fields in its order (``part``
 * is ``entry`` for an entry of its own); a new reference, or NULL with an error. */
static PyObject *make_ref(PyObject *entry, PyObject *part, PyObject *t, PyObject *graveyard, long long view_lo,
                          int whole, long long nbytes) {
    Own w;
    w.n = 0;
    PyObject *r = NULL, *wk, *x, *shape, *stride, *dtype, *conj = Py_False, *neg;
    int b, conj_b, neg_b;
    long long plo, pn, refs;
    GET(shape, t, shape); CALL0(stride, t, stride); GET(dtype, t, dtype);
    GET(x, dtype, is_complex); TRUTH(b, x);
    if (b) { CALL0(conj, t, is_conj); }
    CALL0(neg, t, is_neg);
    GET(x, part, lo); LL(plo, x);
    GET(x, part, nbytes); LL(pn, x);
    if (!(r = bare(K.Ref))) goto error;
    untrack(r); untrack_ints(shape); untrack_ints(stride);
    SET(r, graveyard, Py_None);
    SET(r, entry, entry); SET(r, part, part);
    SET(r, size, shape); SET(r, stride, stride);
    SETLL(r, offset, view_lo - plo);
    SET(r, dtype, dtype);
    TRUTH(conj_b, conj); TRUTH(neg_b, neg);
    SET(r, conj, conj_b ? Py_True : Py_False);
    SET(r, neg, neg);
    SET(r, whole, whole && !(conj_b || neg_b) && plo == 0 && pn == nbytes ? Py_True : Py_False);
    if (part != entry) { GET(x, part, refs); LL(refs, x); SETLL(part, refs, refs + 1); }
    SETLL(r, gen, -1);
    if (!(wk = own(&w, PyObject_CallOneArg(K.RefWeak, r)))) goto error;
    untrack(wk);
    SET(r, weak, wk);
    SET(wk, filed, K.counted);
    GET(x, entry, ref_weaks); if (PyList_Append(x, wk) < 0) goto error;
    GET(x, entry, refs); LL(refs, x); SETLL(entry, refs, refs + 1);
    SET(r, graveyard, graveyard);
    SET(wk, filed, K.owed);
    drop(&w);
    return r;
error:
    Py_XDECREF(r);
    drop(&w);
    return NULL;
}

/* pack(offloader, t): SaveHooks._pack's answer for ``t`` (a parameter is handed back before). */
static PyObject *pack(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "pack(offloader, tensor)"); return NULL; }
    if (!K.ready) { PyErr_SetString(PyExc_RuntimeError, "ssdtrain._cpack: configure() first"); return NULL; }
    PyObject *off = args[0], *t = args[1];
    Own w;
    w.n = 0;
    PyObject *res = NULL, *x, *y, *z;
    int b, lock_held = 0;
    PyObject *lock = NULL;

    /* -- SaveHooks._pack's screening ------------------------------------------------------- */
    PyObject *tt = (PyObject *)Py_TYPE(t);
    if (tt == K.Parameter) { Py_INCREF(t); return t; }
    if (tt != K.Tensor) goto general;
    GET(x, t, layout);
    if (x != K.strided) goto general;
    GET(x, t, is_cuda);
    int is_cuda = x == Py_True;
    if (!is_cuda) { GET(x, t, is_cpu); if (x != Py_True) goto general; }
    GET(x, t, is_quantized); TRUTH(b, x); if (b) goto general;
    long long nbytes;
    GET(x, t, nbytes); LL(nbytes, x);
    if (!nbytes) goto general;
    GET(x, off, _keep_depth);
    if (!(y = own(&w, PySequence_GetItem(x, 0)))) goto error;
    TRUTH(b, y); if (b) goto general;
    GET(x, off, _closed); TRUTH(b, x); if (b) goto general;
    GET(x, K.profiler, _is_profiler_enabled); TRUTH(b, x); if (b) goto general;
    PyObject *base, *src;
    GET(base, t, _base);
    src = base == Py_None ? t : base;
    if ((PyObject *)Py_TYPE(src) != K.Tensor) {
        if ((PyObject *)Py_TYPE(src) == K.Parameter) { res = PyObject_CallMethodNoArgs(t, S_detach); goto done; }
        goto general;
    }
    CALL0(x, t, _is_zerotensor); TRUTH(b, x); if (b) goto general;
    GET(x, src, requires_grad); TRUTH(b, x);
    if (b) {
        GET(x, src, is_leaf); TRUTH(b, x);
        if (b) { res = leaf_or_detached(t); goto done; }
    }
    PyObject *fn;
    GET(fn, src, grad_fn);
    if (fn != Py_None) {
        GET(x, (PyObject *)Py_TYPE(fn), __name__);
        if (PyUnicode_Check(x) && PyUnicode_Compare(x, K.to_copy) == 0) goto general;
        if (PyErr_Occurred()) goto error;
    }
    if (is_cuda) {
        CALL0(x, K.device, capturing_now); TRUTH(b, x); if (b) goto general;
    }
    PyObject *storage, *key;
    CALL0(storage, t, untyped_storage);
    GET(key, storage, _cdata);
    GET(x, off, _pinned);
    if ((b = PySequence_Contains(x, key)) < 0) goto error;
    if (b) { res = leaf_or_detached(t); goto done; }

    /* -- SaveHooks._pack_plain: only a save that joins its scope's open group, or a hit ------- */
    long long storage_bytes;
    CALL0(x, storage, nbytes); LL(storage_bytes, x);
    PyObject *scope = Py_None, *active;
    GET(x, off, _scopes); GET(active, x, active);
    Py_ssize_t na = PyList_Check(active) ? PyList_GET_SIZE(active) : -1;
    if (na < 0) goto plain;
    if (na) {
        if (!(x = own(&w, PySequence_GetItem(PyList_GET_ITEM(active, na - 1), 1)))) goto error;
        scope = x;
    }
    if (scope == Py_None) goto plain;
    PyObject *stats_id;
    GET(stats_id, scope, stats_id);
    GET(x, scope, backward_started); TRUTH(b, x);
    if (b && stats_id == Py_None) goto plain;
    PyObject *tier;
    GET(tier, off, _tier);
    if (tier == Py_None) goto plain;
    if (!is_cuda) { GET(x, off, _tier_cpu); TRUTH(b, x); if (!b) goto plain; }
    long long small_bytes;
    GET(x, off, _small_bytes); LL(small_bytes, x);
    if (storage_bytes < small_bytes) goto plain;
    PyObject *cache, *writer, *graveyard;
    GET(cache, off, _cache); GET(writer, off, _writer); GET(graveyard, off, _graveyard);
    {   /* the safe point's conditions, asked as _pack_plain asks them; its call, as it makes it */
        int due = 0;
        TRUTH(due, graveyard);
        if (!due) { GET(x, writer, completed); TRUTH(due, x); }
        if (!due) { GET(x, cache, late); TRUTH(due, x); }
        if (!due) { GET(y, cache, small); GET(x, y, dead); TRUTH(due, x); }
        if (!due) { GET(x, cache, lagging); TRUTH(due, x); }
        if (!due) { GET(y, off, _failures); GET(x, y, pending); TRUTH(due, x); }
        if (due) {
            PyObject *kw = own(&w, PyDict_New());
            if (kw == NULL || PyDict_SetItem(kw, S_raise_errors, Py_True) < 0) goto error;
            GET(x, off, _safe_point);
            if (!own(&w, PyObject_Call(x, K.empty, kw))) goto error;
        }
    }
    PyObject *g;
    GET(g, scope, group);
    int may_join = g != Py_None;
    if (may_join) {  /* a test's or a variant's join in hooks' place: the Python path calls it */
        PyObject *hj = PyDict_GetItemWithError(K.hooks, S_join);
        if (hj != K.group_join) { if (PyErr_Occurred()) goto error; may_join = 0; }
    }
    PyObject *op;
    {
        PyObject *opnow = PyDict_GetItemWithError(K.hooks, S__op_now);
        if (opnow == NULL) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "hooks._op_now"); goto error; }
        if (!(op = own(&w, PyObject_CallNoArgs(opnow)))) goto error;
    }
    /* the view's bytes and the entry's (views.byte_span, views.entry_span) */
    long long view_lo, view_hi, lo, hi;
    int whole = 0;
    CALL0(x, t, is_contiguous); TRUTH(b, x);
    if (!b) {
        long long esize, soff, reach = 0;
        CALL0(x, t, element_size); LL(esize, x);
        CALL0(x, t, storage_offset); LL(soff, x);
        PyObject *shape, *stride;
        GET(shape, t, shape); CALL0(stride, t, stride);
        Py_ssize_t nd = PyTuple_Check(shape) && PyTuple_Check(stride) ? PyTuple_GET_SIZE(shape) : -1;
        if (nd < 0 || PyTuple_GET_SIZE(stride) != nd) goto plain;
        for (Py_ssize_t i = 0; i < nd; i++) {
            long long n_, s_;
            LL(n_, PyTuple_GET_ITEM(shape, i)); LL(s_, PyTuple_GET_ITEM(stride, i));
            reach += (n_ - 1) * s_;
        }
        view_lo = soff * esize;
        view_hi = view_lo + (reach + 1) * esize;
    } else if (nbytes == storage_bytes) {
        view_lo = 0; view_hi = nbytes; whole = 1;
    } else {
        long long soff, isz;
        CALL0(x, t, storage_offset); LL(soff, x);
        GET(x, t, itemsize); LL(isz, x);
        view_lo = soff * isz; view_hi = view_lo + nbytes;
    }
    if (2 * (view_hi - view_lo) >= storage_bytes) { lo = 0; hi = storage_bytes; }
    else { lo = view_lo - floor_mod(view_lo, K.span_align); hi = view_hi; }
    long long n = hi - lo;

    GET(lock, off, _lock);
    CALL0(x, lock, acquire);
    lock_held = 1;
    GET(x, cache, index); GET(y, x, keys);
    if ((b = PySequence_Contains(y, key)) < 0) goto error;
    if (b) {  /* a storage saved before: StorageIndex.find, where none of its bucket expired */
        PyObject *bucket, *found = NULL;
        long long tv;
        GET(x, cache, index); GET(y, x, _by_key);
        if (!(bucket = own(&w, PyObject_GetItem(y, key)))) goto error;
        if (!PyList_Check(bucket)) goto plain_unlock;
        GET(x, t, _version); LL(tv, x);
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(bucket) && found == NULL; i++) {
            PyObject *item = PyList_GET_ITEM(bucket, i), *st;
            long long iv, ilo, in_;
            GET(x, item, storage_ref); GET(y, x, cdata);
            if (!(x = own(&w, PyObject_CallOneArg(K.expired, y)))) goto error;
            TRUTH(b, x); if (b) goto plain_unlock;  /* Python's to take out of the index */
            GET(x, item, version); LL(iv, x);
            if (iv != tv) continue;
            if ((PyObject *)Py_TYPE(item) == K.Part) { GET(y, item, entry); GET(st, y, state); }
            else { GET(st, item, state); }
            if (st != K.kept && st != K.queued) continue;
            GET(x, item, lo); LL(ilo, x);
            GET(x, item, nbytes); LL(in_, x);
            if (ilo <= view_lo && view_hi <= ilo + in_) found = item;
        }
        if (found == NULL) goto plain_unlock;  /* a new entry or part: Python's */
        /* a hit: _pack_plain's changes, in its order */
        PyObject *entry = found, *peak_, *counters_, *r;
        if ((PyObject *)Py_TYPE(found) == K.Part) {
            GET(entry, found, entry);
            SET(found, whole, Py_None);  /* saved again: its read is bytes */
        }
        GET(peak_, off, _peak);
        if (peak_produced(peak_, nbytes) < 0) goto error;
        PyObject *clock_;
        long long c_saves;
        GET(clock_, tier, clock);  /* CopyClock.produced(0): a save, no bytes */
        GET(x, clock_, saves); LL(c_saves, x);
        SETLL(clock_, saves, c_saves + 1);
        GET(y, clock_, _positions); GET(x, clock_, pos); if (PyList_Append(y, x) < 0) goto error;
        GET(counters_, off, _counters);  /* Counters.add(stats_id, "saved_bytes", nbytes) */
        if (stats_id == Py_None) {
            long long v_;
            PyObject *tot;
            GET(tot, counters_, total);
            GET(x, tot, saved_bytes); LL(v_, x); SETLL(tot, saved_bytes, v_ + nbytes);
        } else {
            PyObject *a1;
            NEWLL(a1, nbytes);
            if (!own(&w, PyObject_CallMethodObjArgs(counters_, S_add, stats_id, S_saved_bytes, a1, NULL))) goto error;
        }
        if (!(r = own(&w, make_ref(entry, found, t, graveyard, view_lo, whole, nbytes)))) goto error;
        lock_held = 0;
        if (!own(&w, PyObject_CallMethodNoArgs(lock, S_release))) goto error;
        Py_INCREF(r);
        res = r;
        goto pump;
    }
    if (!may_join) goto plain_unlock;
    /* -- the questions, nothing changed yet (group.join's, in its order) ------------------- */
    PyObject *gx, *region, *clock, *policy;
    long long at, end, reserved;
    GET(gx, g, extent); GET(region, gx, region);
    if (region == Py_None) goto plain_unlock;
    GET(x, gx, used); LL(at, x);
    end = at + (-floor_div(-n, K.align)) * K.align;
    GET(x, region, reserved); LL(reserved, x);
    if (end > reserved) goto plain_unlock;
    GET(clock, tier, clock); GET(policy, off, _policy);
    GET(x, policy, when_full);
    int keep = PyUnicode_Check(x) && PyUnicode_CompareWithASCIIString(x, "keep") == 0;
    if (keep) { GET(x, clock, closed); TRUTH(b, x); if (b) goto plain_unlock; }
    long long min_bytes;
    GET(x, policy, min_bytes); LL(min_bytes, x);
    if (n < min_bytes) goto plain_unlock;
    GET(x, tier, _forked); TRUTH(b, x); if (b) goto plain_unlock;
    long long inflight;
    GET(x, writer, inflight_bytes); LL(inflight, x);
    if (inflight) {
        long long most;
        GET(x, writer, _max_inflight); LL(most, x);
        if (inflight + n > most) goto plain_unlock;
    }
    GET(x, policy, keep_from_layer);
    if (x != Py_None) {
        long long from, layer_;
        PyObject *stack;
        LL(from, x);
        GET(stack, off, _layer_stack); TRUTH(b, stack);
        if (b) {
            if (!(y = own(&w, PySequence_GetItem(stack, -1)))) goto error;
            if (y != Py_None) { LL(layer_, y); if (layer_ >= from) goto plain_unlock; }
        }
    }
    /* Group.takes(n, producer_stream(t), t.device, off._group_saves) */
    PyObject *stream, *dev, *parts;
    GET(x, K.device, _model);
    if (x != Py_None || is_cuda) {
        if (!(stream = own(&w, PyObject_CallMethodOneArg(K.device, S_producer_stream, t)))) goto error;
    } else {
        stream = Py_None;
    }
    GET(dev, t, device);
    GET(parts, g, parts);
    if (!PyList_Check(parts) || PyList_GET_SIZE(parts) == 0) goto plain_unlock;
    long long most, last_n, g_n;
    GET(x, off, _group_saves); LL(most, x);
    GET(x, PyList_GET_ITEM(parts, PyList_GET_SIZE(parts) - 1), nbytes); LL(last_n, x);
    if (!(PyList_GET_SIZE(parts) < most || 4 * n < last_n)) goto plain_unlock;
    GET(x, g, nbytes); LL(g_n, x);
    if (g_n + n > K.group_bytes) goto plain_unlock;
    GET(x, g, stream); if (x != stream) goto plain_unlock;
    GET(x, g, device);
    if ((b = PyObject_RichCompareBool(x, dev, Py_EQ)) < 0) goto error;
    if (!b) goto plain_unlock;
    /* CopyClock.produced(n) then allows(n), asked before either counts (a refusal: Python's) */
    long long c_pos, c_saves, c_sent = 0, c_pending = 0;
    GET(x, clock, pos); LL(c_pos, x);
    GET(x, clock, saves); LL(c_saves, x);
    c_pos += n; c_saves += 1;
    if (keep) {
        double size = 1.0;
        PyObject *refp;
        GET(refp, clock, _ref_positions);
        Py_ssize_t nref = PyList_Check(refp) ? PyList_GET_SIZE(refp) : -1;
        if (nref < 0) goto plain_unlock;
        if (nref) {
            long long atp;
            LL(atp, PyList_GET_ITEM(refp, (c_saves < nref ? c_saves : nref) - 1));
            size = atp > 0 ? (double)c_pos / (double)atp : 1.0;
        }
        GET(x, clock, sent); LL(c_sent, x);
        GET(x, clock, pending); LL(c_pending, x);
        PyObject *limit;
        GET(limit, clock, limit);
        if (limit != Py_None) {
            double most_;
            PyObject *hc, *eng;
            GET(hc, clock, host_cost); TRUTH(b, limit);
            int simple = hc == Py_None || !b;
            if (!simple) { GET(eng, clock, engine); TRUTH(b, eng); simple = !b; }
            if (simple) {
                long long lim;
                LL(lim, limit);
                most_ = (double)lim * size;
            } else {
                PyObject *s_;
                if (!(s_ = own(&w, PyFloat_FromDouble(size)))) goto error;
                if (!(y = own(&w, PyObject_CallMethodOneArg(clock, S__limit_at, s_)))) goto error;
                most_ = PyFloat_AsDouble(y);
                if (most_ == -1.0 && PyErr_Occurred()) goto error;
            }
            if ((double)(c_sent + n) > most_) goto plain_unlock;
        }
        PyObject *ratio;
        GET(ratio, clock, ratio);
        if (ratio != Py_None) {
            double r = PyFloat_AsDouble(ratio), tail, total;
            if (r == -1.0 && PyErr_Occurred()) goto error;
            GET(x, clock, tail); tail = PyFloat_AsDouble(x); if (tail == -1.0 && PyErr_Occurred()) goto error;
            GET(x, clock, total); total = PyFloat_AsDouble(x); if (total == -1.0 && PyErr_Occurred()) goto error;
            double from = tail >= (double)c_pos ? tail : (double)c_pos;
            if (from + (double)(c_pending + n) * r * K.due_margin > total * size) goto plain_unlock;
        }
    }
    PyObject *peak, *counters, *total_stats;
    GET(peak, off, _peak);
    GET(counters, off, _counters);
    GET(total_stats, counters, total);
    long long version;
    GET(x, t, _version); LL(version, x);
    PyObject *detached, *tweak, *sweak_cdata;
    CALL0(detached, t, detach);
    if (!(tweak = own(&w, PyWeakref_NewRef(t, NULL)))) goto error;
    untrack(tweak);
    CALL0(sweak_cdata, storage, _weak_ref);

    /* -- it joins: the changes, in the Python path's order ---------------------------------- */
    if (peak_produced(peak, nbytes) < 0) goto error;
    /* CopyClock.produced(n); allows(n) where the policy keeps (join asks it only then) */
    NEWLL(x, c_pos); SET(clock, pos, x);
    GET(y, clock, _positions); if (PyList_Append(y, x) < 0) goto error;
    SETLL(clock, saves, c_saves);
    if (keep) { SETLL(clock, sent, c_sent + n); SETLL(clock, pending, c_pending + n); }
    SETLL(gx, used, end);
    /* HostExtent(region.slab, region.offset + at, 0, n) */
    PyObject *ext, *roff;
    if (!(ext = own(&w, bare(K.HostExtent)))) goto error;
    untrack(ext);
    GET(x, region, slab); SET(ext, slab, x);
    GET(roff, region, offset);
    long long roff_;
    LL(roff_, roff);
    SETLL(ext, offset, roff_ + at);
    NEWLL(z, 0);
    SET(ext, reserved, z);
    SETLL(ext, nbytes, n);
    SET(ext, length, z);
    SETLL(ext, path_index, -1);
    SET(ext, landed, Py_None); SET(ext, due, K.inf); SET(ext, back, Py_None); SET(ext, ordered, Py_None);
    /* Group.add: its StorageRef and Part */
    PyObject *sref, *p;
    if (!(sref = own(&w, bare(K.StorageRef)))) goto error;
    untrack(sref);
    SET(sref, cdata, sweak_cdata);
    if (!(p = own(&w, bare(K.Part)))) goto error;
    SET(p, entry, g);
    SETLL(p, index, (long long)PyList_GET_SIZE(parts));
    SET(p, key, key); SET(p, storage_ref, sref);
    SETLL(p, version, version);
    SET(p, data, storage);
    SETLL(p, lo, lo); SETLL(p, nbytes, n);
    SET(p, guard, detached); SET(p, guard_weak, tweak); SET(p, extent, ext);
    SET(p, tainted, Py_None); SET(p, whole, Py_None); SET(p, refs, z); SET(p, unpacked, z);
    if (PyList_Append(parts, p) < 0) goto error;
    GET(x, gx, parts); if (PyList_Append(x, ext) < 0) goto error;
    SETLL(g, nbytes, g_n + n);
    /* StorageIndex.add(p): the key has no bucket (asked above) */
    GET(x, cache, index); GET(y, x, _by_key);
    if (!(z = own(&w, PyList_New(1)))) goto error;
    Py_INCREF(p); PyList_SET_ITEM(z, 0, p);
    if (PyObject_SetItem(y, key, z) < 0) goto error;
    /* Counters.joined(scope.stats_id, nbytes, n) */
    if (stats_id == Py_None) {
        long long v_;
        GET(x, total_stats, saved_bytes); LL(v_, x); SETLL(total_stats, saved_bytes, v_ + nbytes);
        GET(x, total_stats, unique_bytes); LL(v_, x); SETLL(total_stats, unique_bytes, v_ + n);
        GET(x, total_stats, resident_bytes); LL(v_, x);
        v_ += n;
        SETLL(total_stats, resident_bytes, v_ < 0 ? 0 : v_);
    } else {
        PyObject *a1, *a2;
        NEWLL(a1, nbytes); NEWLL(a2, n);
        if (!own(&w, PyObject_CallMethodObjArgs(counters, S_joined, stats_id, a1, a2, NULL))) goto error;
    }
    if (fn == Py_None) SET(g, op, op);  /* Note [bytes an earlier op made may go at once] */
    /* Ref(g, t, graveyard, view_lo, whole, p) */
    PyObject *r;
    if (!(r = own(&w, make_ref(g, p, t, graveyard, view_lo, whole, nbytes)))) goto error;
    GET(x, r, whole);
    if (x == Py_True) {  /* Note [a whole save is read into its own shape] */
        PyObject *pair;
        GET(y, r, size); GET(z, r, dtype);
        pair = own(&w, PyTuple_Pack(2, y, z));
        if (pair == NULL) goto error;
        if (!PyObject_GC_IsTracked(y)) untrack(pair);  /* (size, dtype): its size untracked */
        SET(p, whole, pair);
    }
    lock_held = 0;
    if (!own(&w, PyObject_CallMethodNoArgs(lock, S_release))) goto error;
    Py_INCREF(r);
    res = r;
pump:  /* pack's pump, as _pack_plain ends */
    GET(x, writer, _queue); TRUTH(b, x);
    if (b) {
        GET(x, writer, pack_pumps); TRUTH(b, x);
        if (b && !own(&w, PyObject_CallMethodNoArgs(writer, S_pump))) { Py_CLEAR(res); goto error; }
    }
    goto done;

plain_unlock:
    lock_held = 0;
    if (!own(&w, PyObject_CallMethodNoArgs(lock, S_release))) goto error;
plain:
    res = PyObject_CallMethodObjArgs(off, S__pack_plain, t, storage, key, NULL);
    goto done;
general:
    res = PyObject_CallMethodOneArg(off, S__pack_general, t);
    goto done;
error:
    if (lock_held) {  /* the error first, then the lock given back */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *ok = PyObject_CallMethodNoArgs(lock, S_release);
        Py_XDECREF(ok);
        PyErr_Restore(et, ev, tb);
    }
    res = NULL;
done:
    drop(&w);
    return res;
}

static PyObject *abi(PyObject *mod, PyObject *unused) { return PyLong_FromLong(NATIVE_ABI); }

/* Note [a batch of copies releases the GIL once] (``ssdtrain/device/copies.py`` has the whole Note)
 * The copies of a batch, read into a C array with the GIL held, then made with it released once. */
typedef struct { unsigned long long dst, src, n; } Copy;

static Copy *read_copies(PyObject *triples, Py_ssize_t *count) {
    PyObject *seq = PySequence_Fast(triples, "a list of (dst, src, nbytes)");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Copy *c = PyMem_Malloc(sizeof(Copy) * (n ? n : 1));
    if (c == NULL) { Py_DECREF(seq); PyErr_NoMemory(); return NULL; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 3) {
            PyErr_SetString(PyExc_TypeError, "a copy is a tuple (dst, src, nbytes)");
            goto error;
        }
        c[i].dst = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 0));
        c[i].src = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 1));
        c[i].n = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 2));
        if (PyErr_Occurred()) goto error;
    }
    Py_DECREF(seq);
    *count = n;
    return c;
error:
    PyMem_Free(c);
    Py_DECREF(seq);
    return NULL;
}

/* memcpy_many([(dst, src, nbytes), ...]): host memory to host memory, in order. */
static PyObject *memcpy_many(PyObject *mod, PyObject *triples) {
    Py_ssize_t n;
    Copy *c = read_copies(triples, &n);
    if (c == NULL) return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) memmove((void *)(uintptr_t)c[i].dst, (const void *)(uintptr_t)c[i].src, c[i].n);
    Py_END_ALLOW_THREADS
    PyMem_Free(c);
    Py_RETURN_NONE;
}

/* call_copies(fn, stream, kind, [(dst, src, nbytes), ...][, wait, [event, ...]]): first
 * wait(stream, event, 0) for each event (cudaStreamWaitEvent's signature), then fn(dst, src, nbytes,
 * kind, stream) for each copy (cudaMemcpyAsync's), in order, the CUDA runtime's addresses from
 * ctypes, until one answers an error: (events waited for, copies made, that error), or (all, all, 0).
 * Note [a batch's waits release the GIL with its copies] (``ssdtrain/device/copies.py``). */
typedef int (*copy_fn)(void *, const void *, size_t, int, void *);
typedef int (*wait_fn)(void *, void *, unsigned int);

static PyObject *call_copies(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "call_copies(fn, stream, kind, copies[, wait, events])");
        return NULL;
    }
    unsigned long long fn = PyLong_AsUnsignedLongLong(args[0]);
    unsigned long long stream = PyLong_AsUnsignedLongLong(args[1]);
    long kind = PyLong_AsLong(args[2]);
    unsigned long long wait = nargs == 6 ? PyLong_AsUnsignedLongLong(args[4]) : 0;
    if (PyErr_Occurred()) return NULL;
    if (!fn) { PyErr_SetString(PyExc_ValueError, "call_copies: no function"); return NULL; }
    Py_ssize_t ne = 0, n, i = 0, w = 0;
    unsigned long long *ev = NULL;
    if (nargs == 6) {
        PyObject *seq = PySequence_Fast(args[5], "a list of events");
        if (seq == NULL) return NULL;
        ne = PySequence_Fast_GET_SIZE(seq);
        if (ne && !wait) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "call_copies: events to wait for and no function to wait with");
            return NULL;
        }
        ev = PyMem_Malloc(sizeof(*ev) * (ne ? ne : 1));
        if (ev == NULL) { Py_DECREF(seq); return PyErr_NoMemory(); }
        for (Py_ssize_t k = 0; k < ne; k++) ev[k] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, k));
        Py_DECREF(seq);
        if (PyErr_Occurred()) { PyMem_Free(ev); return NULL; }
    }
    Copy *c = read_copies(args[3], &n);
    if (c == NULL) { PyMem_Free(ev); return NULL; }
    int err = 0;
    copy_fn f = (copy_fn)(uintptr_t)fn;
    wait_fn g = (wait_fn)(uintptr_t)wait;
    Py_BEGIN_ALLOW_THREADS
    for (w = 0; w < ne; w++) {
        err = g((void *)(uintptr_t)stream, (void *)(uintptr_t)ev[w], 0);
        if (err) break;
    }
    if (!err) {
        for (i = 0; i < n; i++) {
            err = f((void *)(uintptr_t)c[i].dst, (const void *)(uintptr_t)c[i].src, (size_t)c[i].n, (int)kind,
                    (void *)(uintptr_t)stream);
            if (err) break;
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(c);
    PyMem_Free(ev);
    return Py_BuildValue("(nni)", w, i, err);
}

static PyMethodDef methods[] = {
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL, "SaveHooks._pack, compiled for a save that joins its scope's open group."},
    {"configure", (PyCFunction)configure, METH_O, "The classes and constants pack uses, from hooks.py."},
    {"abi", abi, METH_NOARGS, "The number hooks.py checks before it uses this build."},
    {"memcpy_many", memcpy_many, METH_O, "Host copies (dst, src, nbytes), in order, the GIL released once."},
    {"call_copies", (PyCFunction)(void (*)(void))call_copies, METH_FASTCALL,
     "wait(stream, event, 0) for each event, then fn(dst, src, nbytes, kind, stream) for each copy, the GIL "
     "released once: (waited, made, error)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpack(void) {
#define INTERN(n) if (!(S_##n = PyUnicode_InternFromString(#n))) return NULL;
    NAMES(INTERN)
#undef INTERN
    return PyModule_Create(&module);
}
