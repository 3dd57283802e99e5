/* _relaycore: the relay's mechanics in C, on the event loop's thread; Python keeps every
 * decision (issue 15). Optional: proxy.userspace.corefwd uses it when it is built and
 * KPX_NO_EXTENSIONS is unset; the pure-Python relay (forwarder.py) is the fallback.
 *
 * What it does, and the Python it calls (once per poll, never per event):
 *
 * - accept on the listeners it is given (level-triggered, up to ACCEPT_BATCH per
 *   listener per poll) and hand the batch to owner.core_decide([(listener, client_ip,
 *   client_port, local_ip, local_port), ...]); one answer per entry: None (it was
 *   refused: RST) or (endpoint_ip, endpoint_port, bind_ip or None, key, metrics);
 * - connect upstream (non-blocking; IP_TRANSPARENT bound to bind_ip when given), with a
 *   deadline (one timeout for all, so a FIFO); a failure or a timeout goes to
 *   owner.core_failed([(key, metrics, failed, client_ip, client_port, endpoint_ip,
 *   endpoint_port, errno, snat), ...]), answered with (failed, answer or None);
 * - relay bytes both ways, as bench/relayfloor.c does: both sockets registered once,
 *   edge-triggered, one shared read buffer; only the unsent rest of a read is copied,
 *   and its source is not read again until the rest is taken (the kernel's windows do
 *   the queueing); EOF is passed on as shutdown(SHUT_WR), an error as an RST on both;
 * - expire idle connections as Forwarder._sweep does (the byte counts, then the
 *   received segments at half the timeout and at the timeout, then the send queues);
 * - report what ended: owner.core_finished([(metrics, bytes_to_endpoint,
 *   bytes_to_client, why, client_ip, client_port, endpoint_ip, endpoint_port, idle),
 *   ...]) where why is 0 (closed), 1 (reset), 2 (aborted), 3 (idle past the established
 *   timeout), 4 (idle past the close-wait timeout); the addresses only for 3 and 4;
 * - and what the listeners need: owner.core_listener(listener, errno): 0 is "at
 *   capacity, stop reading", anything else a failed accept (EMFILE...);
 *   owner.core_starved(metrics, errno): no upstream socket could be made.
 *
 * Counters it keeps on the metrics objects itself (they are plain ints, flushed by
 * Python): forwarded_snat / forwarded_direct when a connect succeeds, and the bytes of
 * live connections at each sweep (``touch`` is called when one becomes dirty).
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <arpa/inet.h>
#include <errno.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#ifndef IP_TRANSPARENT
#define IP_TRANSPARENT 19
#endif
#ifndef IPV6_TRANSPARENT
#define IPV6_TRANSPARENT 75
#endif
#ifndef IP_BIND_ADDRESS_NO_PORT
#define IP_BIND_ADDRESS_NO_PORT 24
#endif

#define READ_SIZE (256 * 1024)
#define ACCEPT_BATCH 64
#define MAX_EVENTS 256
#define MAX_PENDING 1024
#define POLL_ROUNDS 4
#define FAIR_READS 16 /* full reads of one direction per turn (4 MiB): then the others' */

#define TAG_CLIENT 0
#define TAG_UPSTREAM 1
#define TAG_LISTENER 2
#define TAG_TIMER 3
#define TAG_MASK 3

#define CONNECTING 0
#define LINKED 1
#define DEAD 2

#define WHY_CLOSED 0
#define WHY_RESET 1
#define WHY_ABORTED 2
#define WHY_ESTABLISHED 3
#define WHY_CLOSE_WAIT 4

#define LIS_STEERED 1
#define LIS_REFUSE_LOOPBACK 2
#define LIS_BACKOFF 4

/* One direction: read from fd[d], written to fd[1 - d]. */
struct half {
    char *rest;       /* the unsent rest of a read (malloc'd), or NULL */
    uint32_t off, len;
    uint8_t eof;      /* fd[d] sent FIN (we read 0) */
    uint8_t shut;     /* fd[1 - d] was sent FIN */
    uint64_t nbytes;  /* read from fd[d] */
};

struct conn {
    int fd[2];        /* the client; the upstream socket, -1 while there is none */
    uint8_t phase, snat;
    struct half h[2]; /* [0] client -> endpoint, [1] endpoint -> client */
    struct sockaddr_storage peer, to;
    PyObject *key, *metrics, *failed; /* owned references; failed: NULL until one */
    /* the idle sweep (Forwarder._sweep) */
    int64_t mark, segs;
    double idle_since;
    uint64_t counted[2];
    /* connect deadline FIFO, and the list of every live connection */
    double deadline;
    struct conn *dl_prev, *dl_next, *prev, *next, *next_dead;
};

struct lslot {
    int fd, flags;
    PyObject *listener; /* owned; NULL: a free slot */
};

struct pending {
    int cfd, steered;
    PyObject *listener; /* owned: its slot may be emptied before the batch is decided */
    struct sockaddr_storage peer, local;
};

typedef struct {
    PyObject_HEAD
    int ep, timer;
    PyObject *owner;
    double connect_timeout, established, close_wait, sweep_interval, next_sweep, armed;
    long max_connections, live, nlinked, nconnecting;
    int accepting;
    struct conn *head, *tail;       /* live connections, in start order */
    struct conn *dl_head, *dl_tail; /* connects in flight, in deadline order */
    struct conn *dead;              /* freed after the poll that ended them */
    struct lslot *slots;
    int nslots, cap_slots;
    int *free_later, nfree_later, cap_free_later; /* slots released during a poll */
    int *free_slots, nfree_slots;                 /* slots to reuse (cap: cap_slots) */
    int polling;
    struct pending pend[MAX_PENDING];
    int npend;
    PyObject *finished; /* a list while a poll collects them, else NULL */
    PyObject *failed;   /* core_failed's next batch: a tuple per failed connect */
    struct conn **fq;   /* the connection behind each of those tuples, in order */
    int nfq, cap_fq;
    char *buf;
} Core;

static const int one = 1;
static const struct linger rst = {1, 0};
static PyObject *s_core_decide, *s_core_failed, *s_core_finished, *s_core_listener,
    *s_core_starved, *s_touch, *s_dirty, *s_forwarded_snat, *s_forwarded_direct,
    *s_bytes_to_endpoint, *s_bytes_to_client;

/* A Python call failed (a bug): the owner logs it, rate-limited (owner.core_error); the
 * connections it concerned are reset by the caller. */
static void report_error(PyObject *owner, const char *what) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL) PyException_SetTraceback(value, tb);
    PyObject *r = PyObject_CallMethod(owner, "core_error", "sO", what, value ? value : Py_None);
    if (r == NULL) PyErr_WriteUnraisable(owner);
    Py_XDECREF(r);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* -- Python-side counters ------------------------------------------------------------ */

static void add_to(PyObject *owner, PyObject *m, PyObject *name, uint64_t n) {
    if (n == 0) return;
    PyObject *v = PyObject_GetAttr(m, name);
    if (v == NULL) goto fail;
    PyObject *d = PyLong_FromUnsignedLongLong(n);
    if (d == NULL) {
        Py_DECREF(v);
        goto fail;
    }
    PyObject *sum = PyNumber_Add(v, d);
    Py_DECREF(v);
    Py_DECREF(d);
    if (sum == NULL || PyObject_SetAttr(m, name, sum) < 0) {
        Py_XDECREF(sum);
        goto fail;
    }
    Py_DECREF(sum);
    return;
fail:
    report_error(owner, "counting");
}

/* owner.touch(m) unless m is already waiting for a flush. */
static void touch(Core *core, PyObject *m) {
    PyObject *dirty = PyObject_GetAttr(m, s_dirty);
    if (dirty == NULL) {
        report_error(core->owner, "counting");
        return;
    }
    int is = PyObject_IsTrue(dirty);
    Py_DECREF(dirty);
    if (is) return;
    PyObject *r = PyObject_CallMethodOneArg(core->owner, s_touch, m);
    if (r == NULL) report_error(core->owner, "touch");
    Py_XDECREF(r);
}

/* -- addresses ------------------------------------------------------------------------- */

static PyObject *ip_of(const struct sockaddr_storage *ss, int *port) {
    char text[INET6_ADDRSTRLEN];
    if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
        inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof text);
        *port = ntohs(a->sin6_port);
    } else {
        const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
        inet_ntop(AF_INET, &a->sin_addr, text, sizeof text);
        *port = ntohs(a->sin_port);
    }
    return PyUnicode_FromString(text);
}

static int parse_ip(PyObject *text, int port, struct sockaddr_storage *ss, socklen_t *len) {
    const char *s = PyUnicode_AsUTF8(text);
    if (s == NULL) return -1;
    memset(ss, 0, sizeof *ss);
    struct sockaddr_in *v4 = (struct sockaddr_in *)ss;
    struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)ss;
    if (inet_pton(AF_INET, s, &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons((uint16_t)port);
        *len = sizeof *v4;
        return 0;
    }
    if (inet_pton(AF_INET6, s, &v6->sin6_addr) == 1) {
        v6->sin6_family = AF_INET6;
        v6->sin6_port = htons((uint16_t)port);
        *len = sizeof *v6;
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "not an IP address: %R", text);
    return -1;
}

static int is_v6_loopback(const struct sockaddr_storage *ss) {
    return ss->ss_family == AF_INET6 &&
           IN6_IS_ADDR_LOOPBACK(&((const struct sockaddr_in6 *)ss)->sin6_addr);
}

static void reset_fd(int fd) {
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &rst, sizeof rst);
    close(fd);
}

/* -- the timer: the earliest of the next connect deadline and the next sweep ---------- */

static void arm(Core *core) {
    double at = 0;
    if (core->dl_head != NULL) at = core->dl_head->deadline;
    if (core->next_sweep > 0 && (at == 0 || core->next_sweep < at)) at = core->next_sweep;
    if (at == core->armed) return;
    struct itimerspec its = {{0, 0}, {0, 0}};
    if (at > 0) {
        double t = at + 0.0005; /* never early: the check below must find it due */
        its.it_value.tv_sec = (time_t)t;
        its.it_value.tv_nsec = (long)((t - (double)(time_t)t) * 1e9);
    }
    timerfd_settime(core->timer, TFD_TIMER_ABSTIME, &its, NULL);
    core->armed = at;
}

static void dl_remove(Core *core, struct conn *c) {
    if (c->deadline == 0) return;
    if (c->dl_prev) c->dl_prev->dl_next = c->dl_next;
    else core->dl_head = c->dl_next;
    if (c->dl_next) c->dl_next->dl_prev = c->dl_prev;
    else core->dl_tail = c->dl_prev;
    c->dl_prev = c->dl_next = NULL;
    c->deadline = 0;
    core->nconnecting--;
}

static void dl_append(Core *core, struct conn *c) {
    c->deadline = now() + core->connect_timeout;
    c->dl_next = NULL;
    c->dl_prev = core->dl_tail;
    if (core->dl_tail) core->dl_tail->dl_next = c;
    else core->dl_head = c;
    core->dl_tail = c;
    core->nconnecting++;
    if (core->armed == 0 || core->armed > c->deadline) arm(core);
}

/* -- ending a connection ---------------------------------------------------------------- */

static void report(Core *core, struct conn *c, int why, double idle) {
    uint64_t up = c->h[0].nbytes - c->counted[0], down = c->h[1].nbytes - c->counted[1];
    PyObject *entry;
    if (why >= WHY_ESTABLISHED) {
        int cport, eport;
        PyObject *cip = ip_of(&c->peer, &cport), *eip = ip_of(&c->to, &eport);
        entry = Py_BuildValue("(OKKiNiNid)", c->metrics, (unsigned long long)up,
                              (unsigned long long)down, why, cip, cport, eip, eport, idle);
    } else {
        entry = Py_BuildValue("(OKKiOiOid)", c->metrics, (unsigned long long)up,
                              (unsigned long long)down, why, Py_None, 0, Py_None, 0, 0.0);
    }
    if (entry == NULL || PyList_Append(core->finished, entry) < 0)
        report_error(core->owner, "reporting a connection's end");
    Py_XDECREF(entry);
}

/* Close what is open (with an RST if ``why`` is not WHY_CLOSED) and report it ended. */
static void end(Core *core, struct conn *c, int why, double idle) {
    if (c->phase == DEAD) return;
    for (int i = 0; i < 2; i++) {
        if (c->fd[i] < 0) continue;
        /* A connect still in flight is closed plainly: there is nothing to reset. */
        if (why != WHY_CLOSED && !(i == 1 && c->phase == CONNECTING))
            setsockopt(c->fd[i], SOL_SOCKET, SO_LINGER, &rst, sizeof rst);
        close(c->fd[i]); /* closing also leaves the epoll set */
        c->fd[i] = -1;
    }
    dl_remove(core, c);
    if (c->phase == LINKED) core->nlinked--;
    c->phase = DEAD;
    if (c->prev) c->prev->next = c->next;
    else core->head = c->next;
    if (c->next) c->next->prev = c->prev;
    else core->tail = c->prev;
    core->live--;
    report(core, c, why, idle);
    /* This poll may still hold an event of either socket: free after it. */
    c->next_dead = core->dead;
    core->dead = c;
}

static void free_conn(struct conn *c) {
    for (int d = 0; d < 2; d++) free(c->h[d].rest);
    Py_XDECREF(c->key);
    Py_XDECREF(c->metrics);
    Py_XDECREF(c->failed);
    free(c);
}

/* -- relaying ------------------------------------------------------------------------- */

/* Send what is pending for fd[1 - d], then read fd[d] to EAGAIN, sending as it comes.
 * Returns -1 if the connection ended. */
static int pump(Core *core, struct conn *c, int d, uint32_t events) {
    struct half *h = &c->h[d];
    int src = c->fd[d], sink = c->fd[1 - d];
    if (h->rest != NULL) {
        ssize_t n = send(sink, h->rest + h->off, h->len - h->off, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR) return 0;
            end(core, c, WHY_RESET, 0);
            return -1;
        }
        c->mark = -1; /* progress the read counts do not show: a slow reader is not idle */
        h->off += (uint32_t)n;
        if (h->off < h->len) return 0;
        free(h->rest);
        h->rest = NULL;
    }
    for (int reads = 0; !h->eof; reads++) {
        if (reads == FAIR_READS) {
            /* Its turn is over, more is waiting: re-armed, epoll reports it again after
             * every other ready socket (edge-triggered, nothing else would). */
            struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET};
            ev.data.u64 = (uintptr_t)c | (d == 0 ? TAG_CLIENT : TAG_UPSTREAM);
            if (epoll_ctl(core->ep, EPOLL_CTL_MOD, src, &ev) < 0) {
                end(core, c, WHY_RESET, 0);
                return -1;
            }
            return 0;
        }
        ssize_t n = recv(src, core->buf, READ_SIZE, MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR) return 0;
            end(core, c, WHY_RESET, 0);
            return -1;
        }
        if (n == 0) {
            h->eof = 1;
            c->mark = -1; /* a FIN is activity: close-wait is counted from here */
            break;
        }
        h->nbytes += (uint64_t)n;
        ssize_t sent = send(sink, core->buf, (size_t)n, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno != EAGAIN && errno != EINTR) {
                end(core, c, WHY_RESET, 0);
                return -1;
            }
            sent = 0;
        }
        if (sent < n) {
            /* Keep the rest; fd[d] is read again once the sink took it (its EPOLLOUT). */
            h->rest = malloc((size_t)(n - sent));
            if (h->rest == NULL) {
                end(core, c, WHY_RESET, 0);
                return -1;
            }
            memcpy(h->rest, core->buf + sent, (size_t)(n - sent));
            h->off = 0;
            h->len = (uint32_t)(n - sent);
            return 0;
        }
        /* A short read emptied the socket: anything later is a new edge, unless a FIN
         * came with this one (then read on, to the 0). */
        if (n < READ_SIZE && !(events & EPOLLRDHUP)) return 0;
    }
    /* EOF read and nothing pending for the sink: the FIN goes on. */
    if (h->shut) return 0;
    struct half *other = &c->h[1 - d];
    if (other->eof && other->rest == NULL) {
        end(core, c, WHY_CLOSED, 0); /* done both ways: close() sends this last FIN */
        return -1;
    }
    if (shutdown(sink, SHUT_WR) < 0) {
        end(core, c, WHY_RESET, 0);
        return -1;
    }
    h->shut = 1;
    return 0;
}

static void linked(Core *core, struct conn *c) {
    c->phase = LINKED;
    core->nlinked++;
    dl_remove(core, c);
    add_to(core->owner, c->metrics, c->snat ? s_forwarded_snat : s_forwarded_direct, 1);
    touch(core, c->metrics);
    if (core->sweep_interval > 0 && core->next_sweep == 0) {
        core->next_sweep = now() + core->sweep_interval;
        arm(core);
    }
}

static void connect_failed(Core *core, struct conn *c, int err);

static void on_conn(Core *core, struct conn *c, int side, uint32_t events) {
    if (c->phase == DEAD) return;
    if (c->phase == CONNECTING) {
        /* The client waits in the kernel until linked; its edges are caught up then. */
        if (side != TAG_UPSTREAM) return;
        if (events & (EPOLLERR | EPOLLHUP)) {
            int err = 0;
            socklen_t len = sizeof err;
            getsockopt(c->fd[1], SOL_SOCKET, SO_ERROR, &err, &len);
            if (err || !(events & EPOLLOUT)) {
                connect_failed(core, c, err ? err : ECONNREFUSED);
                return;
            }
        }
        if (!(events & EPOLLOUT)) return;
        linked(core, c);
        if ((events & EPOLLIN) && pump(core, c, 1, events) < 0) return;
        pump(core, c, 0, EPOLLRDHUP); /* the client's edges went by unread: read to EAGAIN */
        return;
    }
    if (events & EPOLLERR) {
        /* Reported once (edge-triggered), also for a side that is paused or done reading:
         * an RST is passed on now, not when the side is next read. */
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(c->fd[side == TAG_CLIENT ? 0 : 1], SOL_SOCKET, SO_ERROR, &err, &len);
        if (err) {
            end(core, c, WHY_RESET, 0);
            return;
        }
    }
    /* side d's socket: writable flushes what waits for it (the other direction), readable
     * or failed reads it (its direction). */
    int d = side == TAG_CLIENT ? 0 : 1;
    if (c->h[1 - d].rest != NULL && (events & (EPOLLOUT | EPOLLERR | EPOLLHUP))) {
        /* its source was not read meanwhile: read it to EAGAIN */
        if (pump(core, c, 1 - d, EPOLLRDHUP) < 0) return;
    }
    if (c->h[d].rest == NULL && (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)))
        pump(core, c, d, events);
}

/* -- connecting ----------------------------------------------------------------------- */

/* Start a connect for c to ``answer`` (endpoint_ip, endpoint_port, bind_ip, ...): 0 when
 * in flight, else the errno (c's upstream is -1 then). Under the GIL. */
static int start_connect(Core *core, struct conn *c, PyObject *ip, int port, PyObject *bindto,
                         int *resource) {
    socklen_t to_len, bind_len;
    struct sockaddr_storage b;
    *resource = 0;
    if (parse_ip(ip, port, &c->to, &to_len)) return -1;
    c->snat = bindto == Py_None;
    if (!c->snat && parse_ip(bindto, 0, &b, &bind_len)) return -1;
    int family = c->to.ss_family;
    int ufd = socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (ufd < 0) {
        *resource = 1;
        return errno;
    }
    setsockopt(ufd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (!c->snat) {
        if (family == AF_INET) setsockopt(ufd, SOL_IP, IP_TRANSPARENT, &one, sizeof one);
        else setsockopt(ufd, IPPROTO_IPV6, IPV6_TRANSPARENT, &one, sizeof one);
        setsockopt(ufd, SOL_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
        if (bind(ufd, (struct sockaddr *)&b, bind_len) < 0) {
            int err = errno;
            close(ufd);
            return err;
        }
    }
    if (connect(ufd, (struct sockaddr *)&c->to, to_len) < 0 && errno != EINPROGRESS) {
        int err = errno;
        close(ufd);
        return err;
    }
    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET};
    ev.data.u64 = (uintptr_t)c | TAG_UPSTREAM;
    if (epoll_ctl(core->ep, EPOLL_CTL_ADD, ufd, &ev) < 0) {
        int err = errno;
        close(ufd);
        *resource = 1;
        return err;
    }
    c->fd[1] = ufd;
    dl_append(core, c);
    return 0;
}

static struct conn *new_conn(Core *core, int cfd, const struct sockaddr_storage *peer) {
    struct conn *c = calloc(1, sizeof *c);
    if (c == NULL) return NULL;
    c->fd[0] = cfd;
    c->fd[1] = -1;
    c->peer = *peer;
    c->mark = -1;
    c->segs = -1;
    c->phase = CONNECTING;
    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET};
    ev.data.u64 = (uintptr_t)c | TAG_CLIENT;
    if (epoll_ctl(core->ep, EPOLL_CTL_ADD, cfd, &ev) < 0) {
        free(c);
        return NULL;
    }
    c->prev = core->tail;
    if (core->tail) core->tail->next = c;
    else core->head = c;
    core->tail = c;
    core->live++;
    return c;
}

static void call_owner(Core *core, PyObject *name, PyObject *arg, int err) {
    PyObject *e = PyLong_FromLong(err), *r = NULL;
    if (e != NULL) r = PyObject_CallMethodObjArgs(core->owner, name, arg, e, NULL);
    if (r == NULL) report_error(core->owner, PyUnicode_AsUTF8(name));
    Py_XDECREF(e);
    Py_XDECREF(r);
}

static void starved(Core *core, PyObject *m, int err) { call_owner(core, s_core_starved, m, err); }

/* Connect c as an answer says, and deal with the outcome: in flight; failed at once
 * (queued for core_failed); no socket for it (starved); or an answer that is not one (a
 * bug, named by ``what``). Under the GIL. */
static void connect_as(Core *core, struct conn *c, PyObject *ip, int port, PyObject *bindto,
                       const char *what) {
    int resource;
    int err = start_connect(core, c, ip, port, bindto, &resource);
    if (err < 0) {
        report_error(core->owner, what);
        end(core, c, WHY_ABORTED, 0);
    } else if (resource) {
        end(core, c, WHY_ABORTED, 0);
        starved(core, c->metrics, err);
    } else if (err) {
        connect_failed(core, c, err);
    }
}

/* Take over an accepted client for ``answer`` (a tuple; see the module comment), or reset
 * it (None). Under the GIL. */
static void take(Core *core, int cfd, const struct sockaddr_storage *peer, PyObject *answer) {
    if (answer == Py_None) {
        reset_fd(cfd);
        return;
    }
    PyObject *ip, *bind, *key, *m;
    int port;
    if (!PyArg_ParseTuple(answer, "OiOOO", &ip, &port, &bind, &key, &m)) {
        report_error(core->owner, "core_decide's answer");
        reset_fd(cfd);
        return;
    }
    struct conn *c = new_conn(core, cfd, peer);
    if (c == NULL) {
        reset_fd(cfd);
        starved(core, m, ENOMEM);
        return;
    }
    Py_INCREF(key);
    Py_INCREF(m);
    c->key = key;
    c->metrics = m;
    connect_as(core, c, ip, port, bind, "core_decide's answer");
}

/* A connect failed (or timed out): queue it for owner.core_failed at the end of the poll
 * (or at once, outside one). */
static void flush_failed(Core *core);

static void connect_failed(Core *core, struct conn *c, int err) {
    if (c->fd[1] >= 0) {
        close(c->fd[1]);
        c->fd[1] = -1;
    }
    dl_remove(core, c);
    int cport, eport;
    PyObject *cip = ip_of(&c->peer, &cport), *eip = ip_of(&c->to, &eport);
    PyObject *entry = Py_BuildValue("(OOONiNiii)", c->key, c->metrics,
                                    c->failed ? c->failed : Py_None, cip, cport, eip, eport,
                                    err, (int)c->snat);
    if (entry == NULL || PyList_Append(core->failed, entry) < 0) {
        Py_XDECREF(entry);
        report_error(core->owner, "reporting a failed connect");
        end(core, c, WHY_ABORTED, 0);
        return;
    }
    Py_DECREF(entry);
    if (core->nfq == core->cap_fq) {
        core->cap_fq = core->cap_fq ? 2 * core->cap_fq : 64;
        core->fq = realloc(core->fq, sizeof *core->fq * (size_t)core->cap_fq);
    }
    core->fq[core->nfq++] = c;
    if (!core->polling) flush_failed(core);
}

static void flush_failed(Core *core) {
    while (core->nfq) {
        PyObject *batch = core->failed;
        struct conn **fq = core->fq;
        int n = core->nfq;
        /* A retry that fails at once queues anew: on fresh lists. */
        core->failed = PyList_New(0);
        core->fq = NULL;
        core->nfq = core->cap_fq = 0;
        PyObject *answers = PyObject_CallMethodOneArg(core->owner, s_core_failed, batch);
        if (answers == NULL || !PyList_Check(answers) || PyList_GET_SIZE(answers) != n) {
            if (answers != NULL)
                PyErr_SetString(PyExc_TypeError, "not one answer per failed connect");
            report_error(core->owner, "core_failed");
            for (int i = 0; i < n; i++) end(core, fq[i], WHY_ABORTED, 0);
        } else {
            for (int i = 0; i < n; i++) {
                struct conn *c = fq[i];
                PyObject *a = PyList_GET_ITEM(answers, i), *failed, *answer;
                if (c->phase == DEAD) continue;
                if (!PyArg_ParseTuple(a, "OO", &failed, &answer)) {
                    report_error(core->owner, "core_failed's answer");
                    end(core, c, WHY_ABORTED, 0);
                    continue;
                }
                if (failed != Py_None && c->failed != failed) {
                    Py_INCREF(failed);
                    Py_XSETREF(c->failed, failed);
                }
                if (answer == Py_None) {
                    end(core, c, WHY_ABORTED, 0);
                    continue;
                }
                PyObject *ip, *bind, *key, *m;
                int port;
                if (!PyArg_ParseTuple(answer, "OiOOO", &ip, &port, &bind, &key, &m)) {
                    report_error(core->owner, "core_failed's answer");
                    end(core, c, WHY_ABORTED, 0);
                    continue;
                }
                connect_as(core, c, ip, port, bind, "core_failed's answer");
            }
        }
        Py_XDECREF(answers);
        Py_DECREF(batch);
        free(fq);
    }
}

/* -- accepting ------------------------------------------------------------------------ */

/* Tell the listener's owner; returns 0 if the slot still holds it afterwards. */
static int listener_note(Core *core, int slot, int err) {
    PyObject *listener = core->slots[slot].listener;
    Py_INCREF(listener);
    call_owner(core, s_core_listener, listener, err);
    int gone = core->slots[slot].listener != listener;
    Py_DECREF(listener);
    return gone ? -1 : 0;
}

static void on_listener(Core *core, int slot) {
    /* core->slots may move when Python adds a listener: indexed anew after each call. */
    if (core->slots[slot].listener == NULL) return; /* removed earlier in this poll */
    int fd = core->slots[slot].fd;
    for (int i = 0; i < ACCEPT_BATCH; i++) {
        if (!core->accepting ||
            (core->max_connections && core->live + core->npend >= core->max_connections)) {
            /* Full (or out of fds a moment ago): clients wait in the kernel's queue. */
            listener_note(core, slot, 0);
            return;
        }
        if (core->npend == MAX_PENDING) return; /* level-triggered: reported again */
        struct pending *p = &core->pend[core->npend];
        socklen_t len = sizeof p->peer;
        int cfd = accept4(fd, (struct sockaddr *)&p->peer, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (cfd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno != EAGAIN) {
                listener_note(core, slot, errno);
                return;
            }
            break;
        }
        int flags = core->slots[slot].flags;
        if (flags & (LIS_STEERED | LIS_REFUSE_LOOPBACK)) {
            len = sizeof p->local;
            if (getsockname(cfd, (struct sockaddr *)&p->local, &len) < 0) {
                reset_fd(cfd);
                continue;
            }
            if ((flags & LIS_REFUSE_LOOPBACK) && is_v6_loopback(&p->peer) &&
                is_v6_loopback(&p->local)) {
                reset_fd(cfd); /* the IPv6 wildcard never serves ::1 (listener.py) */
                continue;
            }
        }
        p->cfd = cfd;
        p->steered = flags & LIS_STEERED;
        p->listener = core->slots[slot].listener;
        Py_INCREF(p->listener);
        core->npend++;
    }
    if (core->slots[slot].flags & LIS_BACKOFF) {
        core->slots[slot].flags &= ~LIS_BACKOFF;
        listener_note(core, slot, -1); /* accepting again after a back-off */
    }
}

static void decide_pending(Core *core) {
    int n = core->npend;
    PyObject *batch = PyList_New(n), *answers = NULL;
    if (batch == NULL) goto fail;
    for (int i = 0; i < n; i++) {
        struct pending *p = &core->pend[i];
        int port, lport = 0;
        PyObject *ip = ip_of(&p->peer, &port), *lip;
        if (p->steered) {
            lip = ip_of(&p->local, &lport);
        } else {
            lip = Py_None;
            Py_INCREF(lip);
        }
        PyObject *t = Py_BuildValue("(ONiNi)", p->listener, ip, port, lip, lport);
        if (t == NULL) goto fail;
        PyList_SET_ITEM(batch, i, t);
    }
    answers = PyObject_CallMethodOneArg(core->owner, s_core_decide, batch);
    if (answers == NULL || !PyList_Check(answers) || PyList_GET_SIZE(answers) != n) goto fail;
    core->npend = 0; /* take() may call back into Python, which may poll nothing new */
    for (int i = 0; i < n; i++)
        take(core, core->pend[i].cfd, &core->pend[i].peer, PyList_GET_ITEM(answers, i));
    goto done;
fail:
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "not one answer per client");
    report_error(core->owner, "core_decide");
    for (int i = 0; i < n; i++) reset_fd(core->pend[i].cfd);
    core->npend = 0;
done:
    for (int i = 0; i < n; i++) Py_CLEAR(core->pend[i].listener);
    Py_XDECREF(batch);
    Py_XDECREF(answers);
}

/* -- the idle sweep (Forwarder._sweep, the same rules) ----------------------------------- */

/* Segments fd received (keepalive probes too): tcp_info's tcpi_segs_in, at byte 140. */
static int64_t segs_in(int fd) {
    uint32_t info[36];
    socklen_t len = sizeof info;
    if (fd < 0 || getsockopt(fd, IPPROTO_TCP, TCP_INFO, info, &len) < 0 || len < sizeof info)
        return 0;
    return info[35];
}

static int unsent(struct conn *c, int d) {
    if (c->fd[d] < 0) return 0;
    if (c->h[1 - d].rest != NULL) return 1;
    int queued = 0;
    return ioctl(c->fd[d], SIOCOUTQ, &queued) == 0 && queued > 0;
}

static void sweep(Core *core, double t) {
    for (struct conn *c = core->head, *next; c != NULL; c = next) {
        next = c->next;
        if (c->phase != LINKED) continue; /* connecting: the connect timeout covers it */
        int64_t mark = (int64_t)(c->h[0].nbytes + c->h[1].nbytes);
        if (mark != c->mark) {
            c->mark = mark;
            c->idle_since = t;
            c->segs = -1;
            /* A live connection's bytes reach the counters sweep by sweep. */
            uint64_t up = c->h[0].nbytes - c->counted[0], down = c->h[1].nbytes - c->counted[1];
            if (up || down) {
                add_to(core->owner, c->metrics, s_bytes_to_endpoint, up);
                add_to(core->owner, c->metrics, s_bytes_to_client, down);
                c->counted[0] = c->h[0].nbytes;
                c->counted[1] = c->h[1].nbytes;
                touch(core, c->metrics);
            }
            continue;
        }
        double limit;
        int why;
        if (core->close_wait > 0 && (c->h[0].eof || c->h[1].eof || c->h[0].shut || c->h[1].shut)) {
            limit = core->close_wait;
            why = WHY_CLOSE_WAIT;
        } else {
            limit = core->established;
            why = WHY_ESTABLISHED;
        }
        if (limit <= 0 || t - c->idle_since < limit / 2) continue;
        if (c->segs < 0) {
            c->segs = segs_in(c->fd[0]) + segs_in(c->fd[1]);
            continue;
        }
        if (t - c->idle_since >= limit) {
            int64_t segs = segs_in(c->fd[0]) + segs_in(c->fd[1]);
            if (segs != c->segs) {
                c->segs = segs;
                c->idle_since = t;
                continue;
            }
            if (unsent(c, 0) || unsent(c, 1)) {
                c->idle_since = t;
                continue;
            }
            end(core, c, why, t - c->idle_since);
        }
    }
}

static void on_timer(Core *core) {
    uint64_t ticks;
    if (read(core->timer, &ticks, sizeof ticks) < 0) { /* EAGAIN: nothing due */ }
    core->armed = 0;
    double t = now();
    while (core->dl_head != NULL && core->dl_head->deadline <= t) {
        struct conn *c = core->dl_head;
        connect_failed(core, c, ETIMEDOUT); /* takes it off the FIFO */
    }
    if (core->next_sweep > 0 && core->next_sweep <= t) {
        sweep(core, t);
        core->next_sweep = core->head != NULL ? t + core->sweep_interval : 0;
    }
    arm(core);
}

/* -- the poll ------------------------------------------------------------------------- */

static void end_poll(Core *core) {
    flush_failed(core);
    core->polling = 0;
    while (core->dead != NULL) {
        struct conn *c = core->dead;
        core->dead = c->next_dead;
        free_conn(c);
    }
    for (int i = 0; i < core->nfree_later; i++) {
        core->slots[core->free_later[i]].fd = -1;
        core->free_slots[core->nfree_slots++] = core->free_later[i];
    }
    core->nfree_later = 0;
    if (PyList_GET_SIZE(core->finished)) {
        PyObject *finished = core->finished;
        core->finished = PyList_New(0);
        PyObject *r = PyObject_CallMethodOneArg(core->owner, s_core_finished, finished);
        if (r == NULL) report_error(core->owner, "core_finished");
        Py_XDECREF(r);
        Py_DECREF(finished);
    }
}

static PyObject *Core_poll(Core *self, PyObject *unused) {
    struct epoll_event events[MAX_EVENTS];
    if (self->polling) Py_RETURN_NONE;
    self->polling = 1;
    for (int round = 0; round < POLL_ROUNDS; round++) {
        int n = epoll_wait(self->ep, events, MAX_EVENTS, 0);
        if (n <= 0) break;
        for (int i = 0; i < n; i++) {
            uint64_t data = events[i].data.u64;
            unsigned tag = (unsigned)(data & TAG_MASK);
            if (tag == TAG_LISTENER) on_listener(self, (int)(data >> 2));
            else if (tag == TAG_TIMER) on_timer(self);
            else on_conn(self, (struct conn *)(uintptr_t)(data & ~(uint64_t)TAG_MASK), (int)tag,
                         events[i].events);
        }
        if (self->npend) decide_pending(self);
        if (n < MAX_EVENTS) break;
    }
    end_poll(self);
    Py_RETURN_NONE;
}

/* -- the Python API ------------------------------------------------------------------- */

static int Core_init(Core *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"owner", "connect_timeout", "established", "close_wait",
                            "sweep_interval", "max_connections", NULL};
    PyObject *owner;
    self->ep = self->timer = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Oddddl", names, &owner, &self->connect_timeout,
                                     &self->established, &self->close_wait,
                                     &self->sweep_interval, &self->max_connections))
        return -1;
    Py_INCREF(owner);
    Py_XSETREF(self->owner, owner);
    self->accepting = 1;
    self->ep = epoll_create1(EPOLL_CLOEXEC);
    self->timer = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    self->buf = malloc(READ_SIZE);
    self->finished = PyList_New(0);
    self->failed = PyList_New(0);
    if (self->ep < 0 || self->timer < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (self->buf == NULL || self->finished == NULL || self->failed == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    struct epoll_event ev = {.events = EPOLLIN};
    ev.data.u64 = TAG_TIMER;
    if (epoll_ctl(self->ep, EPOLL_CTL_ADD, self->timer, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static PyObject *Core_add_listener(Core *self, PyObject *args) {
    int fd, flags;
    PyObject *listener;
    if (!PyArg_ParseTuple(args, "iOi", &fd, &listener, &flags)) return NULL;
    int slot;
    if (self->nfree_slots) {
        slot = self->free_slots[--self->nfree_slots];
    } else {
        if (self->nslots == self->cap_slots) {
            int cap = self->cap_slots ? 2 * self->cap_slots : 16;
            struct lslot *s = realloc(self->slots, sizeof *s * (size_t)cap);
            if (s == NULL) return PyErr_NoMemory();
            self->slots = s;
            int *f = realloc(self->free_slots, sizeof *f * (size_t)cap);
            if (f == NULL) return PyErr_NoMemory();
            self->free_slots = f;
            self->cap_slots = cap;
        }
        slot = self->nslots++;
        self->slots[slot] = (struct lslot){-1, 0, NULL};
    }
    struct epoll_event ev = {.events = EPOLLIN};
    ev.data.u64 = ((uint64_t)slot << 2) | TAG_LISTENER;
    if (epoll_ctl(self->ep, EPOLL_CTL_ADD, fd, &ev) < 0) {
        self->free_slots[self->nfree_slots++] = slot;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_INCREF(listener);
    self->slots[slot] = (struct lslot){fd, flags, listener};
    return PyLong_FromLong(slot);
}

static PyObject *Core_remove_listener(Core *self, PyObject *arg) {
    long slot = PyLong_AsLong(arg);
    if (slot == -1 && PyErr_Occurred()) return NULL;
    if (slot < 0 || slot >= self->nslots || self->slots[slot].listener == NULL)
        return PyErr_Format(PyExc_KeyError, "no listener in slot %ld", slot);
    struct lslot *l = &self->slots[slot];
    epoll_ctl(self->ep, EPOLL_CTL_DEL, l->fd, NULL);
    Py_CLEAR(l->listener);
    /* An event of it may still be in this poll's batch: the slot is reused after it. */
    if (self->polling) {
        if (self->nfree_later == self->cap_free_later) {
            int cap = self->cap_free_later ? 2 * self->cap_free_later : 16;
            int *f = realloc(self->free_later, sizeof *f * (size_t)cap);
            if (f == NULL) return PyErr_NoMemory();
            self->free_later = f;
            self->cap_free_later = cap;
        }
        self->free_later[self->nfree_later++] = (int)slot;
    } else {
        l->fd = -1;
        self->free_slots[self->nfree_slots++] = (int)slot;
    }
    Py_RETURN_NONE;
}

/* Relay an accepted client (an fd this now owns) as ``answer`` says: for a client that
 * Python accepted itself. */
static PyObject *Core_take(Core *self, PyObject *args) {
    int fd;
    PyObject *ip, *answer;
    int port;
    if (!PyArg_ParseTuple(args, "iOiO", &fd, &ip, &port, &answer)) return NULL;
    struct sockaddr_storage peer;
    socklen_t len;
    if (parse_ip(ip, port, &peer, &len)) return NULL;
    int polling = self->polling;
    self->polling = 1;
    take(self, fd, &peer, answer);
    if (!polling) end_poll(self);
    else self->polling = polling;
    Py_RETURN_NONE;
}

static PyObject *Core_abort_all(Core *self, PyObject *unused) {
    long n = 0;
    int polling = self->polling;
    self->polling = 1;
    while (self->head != NULL) {
        end(self, self->head, WHY_ABORTED, 0);
        n++;
    }
    /* Connects whose failure was queued are over too. */
    self->nfq = 0;
    Py_SETREF(self->failed, PyList_New(0));
    if (!polling) end_poll(self);
    else self->polling = polling;
    return PyLong_FromLong(n);
}

static PyObject *Core_close(Core *self, PyObject *unused) {
    PyObject *r = Core_abort_all(self, NULL);
    Py_XDECREF(r);
    for (int i = 0; i < self->nslots; i++) Py_CLEAR(self->slots[i].listener);
    self->nslots = self->nfree_slots = 0;
    if (self->ep >= 0) close(self->ep);
    if (self->timer >= 0) close(self->timer);
    self->ep = self->timer = -1;
    Py_RETURN_NONE;
}

static PyObject *Core_fileno(Core *self, PyObject *unused) { return PyLong_FromLong(self->ep); }

static PyObject *Core_get_live(Core *self, void *closure) { return PyLong_FromLong(self->live); }

static PyObject *Core_get_linked(Core *self, void *closure) {
    return PyLong_FromLong(self->nlinked);
}

static PyObject *Core_get_connecting(Core *self, void *closure) {
    return PyLong_FromLong(self->nconnecting);
}

static PyObject *Core_get_sweeping(Core *self, void *closure) {
    return PyBool_FromLong(self->next_sweep > 0);
}

static PyObject *Core_get_accepting(Core *self, void *closure) {
    return PyBool_FromLong(self->accepting);
}

static int Core_set_accepting(Core *self, PyObject *value, void *closure) {
    int v = PyObject_IsTrue(value);
    if (v < 0) return -1;
    self->accepting = v;
    return 0;
}

static PyObject *Core_max_buffered(Core *self, PyObject *unused) {
    /* The most bytes any one connection holds for a side (Forwarder.max_buffered). */
    unsigned long long most = 0;
    for (struct conn *c = self->head; c != NULL; c = c->next)
        for (int d = 0; d < 2; d++)
            if (c->h[d].rest != NULL && c->h[d].len - c->h[d].off > most)
                most = c->h[d].len - c->h[d].off;
    return PyLong_FromUnsignedLongLong(most);
}

static int Core_traverse(Core *self, visitproc visit, void *arg) {
    Py_VISIT(self->owner);
    for (int i = 0; i < self->nslots; i++) Py_VISIT(self->slots[i].listener);
    return 0;
}

static int Core_clear(Core *self) {
    Py_CLEAR(self->owner);
    for (int i = 0; i < self->nslots; i++) Py_CLEAR(self->slots[i].listener);
    return 0;
}

static void Core_dealloc(Core *self) {
    PyObject_GC_UnTrack(self);
    /* Closing the sockets needs no callback: drop what is live without reporting it. */
    while (self->head != NULL) {
        struct conn *c = self->head;
        self->head = c->next;
        for (int i = 0; i < 2; i++)
            if (c->fd[i] >= 0) reset_fd(c->fd[i]);
        free_conn(c);
    }
    while (self->dead != NULL) {
        struct conn *c = self->dead;
        self->dead = c->next_dead;
        free_conn(c);
    }
    for (int i = 0; i < self->npend; i++) {
        reset_fd(self->pend[i].cfd);
        Py_CLEAR(self->pend[i].listener);
    }
    if (self->ep >= 0) close(self->ep);
    if (self->timer >= 0) close(self->timer);
    Core_clear(self);
    free(self->slots);
    free(self->free_later);
    free(self->free_slots);
    free(self->fq);
    free(self->buf);
    Py_XDECREF(self->finished);
    Py_XDECREF(self->failed);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Core_methods[] = {
    {"poll", (PyCFunction)Core_poll, METH_NOARGS, "Handle what is ready (the loop's reader)."},
    {"fileno", (PyCFunction)Core_fileno, METH_NOARGS, "The epoll set's fd."},
    {"add_listener", (PyCFunction)Core_add_listener, METH_VARARGS,
     "add_listener(fd, listener, flags) -> slot: accept on fd."},
    {"remove_listener", (PyCFunction)Core_remove_listener, METH_O,
     "remove_listener(slot): stop accepting there (before its fd is closed)."},
    {"take", (PyCFunction)Core_take, METH_VARARGS,
     "take(fd, client_ip, client_port, answer): relay a client Python accepted."},
    {"abort_all", (PyCFunction)Core_abort_all, METH_NOARGS, "RST every connection; how many."},
    {"max_buffered", (PyCFunction)Core_max_buffered, METH_NOARGS,
     "The most bytes one connection holds for a slow reader."},
    {"close", (PyCFunction)Core_close, METH_NOARGS, "abort_all, then release the fds."},
    {NULL}};

static PyGetSetDef Core_getset[] = {
    {"live", (getter)Core_get_live, NULL, "Connections from accept to their end.", NULL},
    {"linked", (getter)Core_get_linked, NULL, "Connections relaying (connected).", NULL},
    {"connecting", (getter)Core_get_connecting, NULL, "Connects in flight.", NULL},
    {"sweeping", (getter)Core_get_sweeping, NULL, "An idle sweep is due.", NULL},
    {"accepting", (getter)Core_get_accepting, (setter)Core_set_accepting,
     "False: every listener event is answered 'at capacity' (out of fds a moment ago).", NULL},
    {NULL}};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "proxy.userspace._relaycore.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_traverse = (traverseproc)Core_traverse,
    .tp_clear = (inquiry)Core_clear,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
    .tp_doc = "The relay's mechanics: accept, connect, relay, expire (module comment).",
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_relaycore",
                                    "The relay's mechanics in C (proxy.userspace.corefwd).", -1,
                                    NULL};

#define INTERN(var, text)                                                                  \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__relaycore(void) {
    INTERN(s_core_decide, "core_decide");
    INTERN(s_core_failed, "core_failed");
    INTERN(s_core_finished, "core_finished");
    INTERN(s_core_listener, "core_listener");
    INTERN(s_core_starved, "core_starved");
    INTERN(s_touch, "touch");
    INTERN(s_dirty, "dirty");
    INTERN(s_forwarded_snat, "forwarded_snat");
    INTERN(s_forwarded_direct, "forwarded_direct");
    INTERN(s_bytes_to_endpoint, "bytes_to_endpoint");
    INTERN(s_bytes_to_client, "bytes_to_client");
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) return NULL;
    PyModule_AddIntConstant(m, "LIS_STEERED", LIS_STEERED);
    PyModule_AddIntConstant(m, "LIS_REFUSE_LOOPBACK", LIS_REFUSE_LOOPBACK);
    PyModule_AddIntConstant(m, "LIS_BACKOFF", LIS_BACKOFF);
    PyModule_AddIntConstant(m, "WHY_CLOSED", WHY_CLOSED);
    PyModule_AddIntConstant(m, "WHY_RESET", WHY_RESET);
    PyModule_AddIntConstant(m, "WHY_ABORTED", WHY_ABORTED);
    PyModule_AddIntConstant(m, "WHY_ESTABLISHED", WHY_ESTABLISHED);
    PyModule_AddIntConstant(m, "WHY_CLOSE_WAIT", WHY_CLOSE_WAIT);
    return m;
}
