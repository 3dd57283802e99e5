/* relay-floor: the floor of any relay that terminates both TCP connections on this
 * machine (kpx bench, issue 15).
 *
 * One thread and one epoll set, no decision, no timeout and no log: accept4 (up to 64
 * per wake-up, the listener level-triggered), a non-blocking connect to the listener's
 * one backend, TCP_NODELAY on both sockets (as HAProxy: a response that comes in two
 * segments is not held back for an ACK), then bytes both ways through one
 * 16 KiB buffer per direction (HAProxy's default bufsize). Both sockets are registered
 * once, edge-triggered, for reads and writes: no epoll_ctl after that. A half-close is
 * passed on as shutdown(SHUT_WR), or as close() once the other way is done too; an error
 * on either side is an RST on both.
 *
 * So the bench can split the relay's gap to HAProxy (issue 15's cps and rr on the cross
 * path) in the same run: what this pays beyond HAProxy is neither's generality, it is
 * what terminating both connections costs here; what kpx's relay pays beyond this is its
 * Python (the decision, the interpreter between the syscalls).
 *
 * usage: relayfloor LISTEN=BACKEND...   (ADDR:PORT, an IPv6 address as [ADDR]:PORT)
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define BUFSZ 16384
#define ACCEPT_BATCH 64
#define MAX_LISTENERS 16
#define MAX_EVENTS 256

/* Tags in the low bits of epoll's data (every struct is 8-aligned). */
#define TAG_CLIENT 0
#define TAG_BACKEND 1
#define TAG_LISTENER 2
#define TAG_MASK 3

struct listener {
    int fd;
    struct sockaddr_storage backend;
    socklen_t backend_len;
};

/* One direction: bytes read from its source and not yet taken by its sink. */
struct half {
    uint32_t off, len;
    uint8_t eof;  /* the source sent FIN (we read 0) */
    uint8_t shut; /* the sink was sent FIN */
    char buf[BUFSZ];
};

struct conn {
    int fd[2];         /* [0] the client, [1] the backend */
    uint8_t connected; /* the backend's connect finished */
    uint8_t dead;      /* closed; freed once the batch that closed it is done */
    struct conn *next_dead;
    struct half h[2];  /* [0] client -> backend, [1] backend -> client */
};

static struct listener listeners[MAX_LISTENERS];
static int nlisteners;
static int ep;
static struct conn *dead;
static const int one = 1;
static const struct linger rst = {1, 0};

static int parse_addr(const char *text, struct sockaddr_storage *ss, socklen_t *len) {
    char host[64];
    const char *colon = strrchr(text, ':');
    if (colon == NULL || colon == text) return -1;
    size_t n = (size_t)(colon - text);
    if (text[0] == '[') {
        if (n < 3 || text[n - 1] != ']') return -1;
        text++;
        n -= 2;
    }
    if (n >= sizeof host) return -1;
    memcpy(host, text, n);
    host[n] = 0;
    int port = atoi(colon + 1);
    if (port <= 0 || port > 65535) return -1;
    memset(ss, 0, sizeof *ss);
    struct sockaddr_in *v4 = (struct sockaddr_in *)ss;
    struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)ss;
    if (inet_pton(AF_INET, host, &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons((uint16_t)port);
        *len = sizeof *v4;
    } else if (inet_pton(AF_INET6, host, &v6->sin6_addr) == 1) {
        v6->sin6_family = AF_INET6;
        v6->sin6_port = htons((uint16_t)port);
        *len = sizeof *v6;
    } else {
        return -1;
    }
    return 0;
}

static void close_conn(struct conn *c, int reset) {
    if (c->dead) return;
    for (int i = 0; i < 2; i++) {
        if (reset) setsockopt(c->fd[i], SOL_SOCKET, SO_LINGER, &rst, sizeof rst);
        close(c->fd[i]); /* closing also leaves the epoll set */
    }
    /* This batch may still hold an event of the other socket: free after it. */
    c->dead = 1;
    c->next_dead = dead;
    dead = c;
}

/* Move what can be moved from side d to side 1-d; 0 while the connection lives. */
static int pump(struct conn *c, int d, uint32_t events) {
    struct half *h = &c->h[d];
    int src = c->fd[d], sink = c->fd[1 - d];
    for (;;) {
        if (h->len > h->off) {
            ssize_t n = send(sink, h->buf + h->off, h->len - h->off,
                             MSG_DONTWAIT | MSG_NOSIGNAL);
            if (n < 0) {
                if (errno == EAGAIN || errno == EINTR) return 0; /* the sink's EPOLLOUT */
                close_conn(c, 1);
                return -1;
            }
            h->off += (uint32_t)n;
            if (h->off < h->len) return 0;
            h->off = h->len = 0;
        }
        if (h->eof) {
            if (h->shut) return 0;
            struct half *other = &c->h[1 - d];
            if (other->eof && other->len == 0) {
                close_conn(c, 0); /* done both ways: close() sends the last FIN */
                return -1;
            }
            if (shutdown(sink, SHUT_WR) < 0) {
                close_conn(c, 1);
                return -1;
            }
            h->shut = 1;
            return 0;
        }
        ssize_t n = recv(src, h->buf, BUFSZ, MSG_DONTWAIT);
        if (n > 0) {
            h->len = (uint32_t)n;
            /* A short read drained the socket: anything later is a new edge, unless
             * the FIN came with this wake-up (then read on, to the 0). */
            if (n < BUFSZ && !(events & EPOLLRDHUP)) {
                events = 0;
                ssize_t sent = send(sink, h->buf, (size_t)n, MSG_DONTWAIT | MSG_NOSIGNAL);
                if (sent < 0) {
                    if (errno == EAGAIN || errno == EINTR) return 0;
                    close_conn(c, 1);
                    return -1;
                }
                if (sent == n) h->len = 0;
                else h->off = (uint32_t)sent;
                return 0;
            }
            continue;
        }
        if (n == 0) {
            h->eof = 1;
            continue;
        }
        if (errno == EAGAIN || errno == EINTR) return 0;
        close_conn(c, 1);
        return -1;
    }
}

static void on_conn(struct conn *c, int side, uint32_t events) {
    if (c->dead) return;
    /* A FIN, RST or error came with this wake-up: read on to the 0 or the error. */
    uint32_t drain = events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR);
    if (!c->connected) {
        if (side != TAG_BACKEND) return; /* the client waits in the kernel until linked */
        if (events & (EPOLLERR | EPOLLHUP)) {
            int err = 0;
            socklen_t len = sizeof err;
            getsockopt(c->fd[1], SOL_SOCKET, SO_ERROR, &err, &len);
            if (err) {
                close_conn(c, 1);
                return;
            }
        }
        if (!(events & EPOLLOUT)) return;
        c->connected = 1;
        if ((events & EPOLLIN) && pump(c, 1, drain) < 0) return;
        /* The client's edges went by unread while connecting: read it to EAGAIN. */
        pump(c, 0, EPOLLRDHUP);
        return;
    }
    struct half *in = &c->h[1 - side]; /* bytes on their way to this side */
    if (in->len > in->off && (events & (EPOLLOUT | EPOLLERR | EPOLLHUP))) {
        /* Flush them; their source was not read meanwhile: read it to EAGAIN. */
        if (pump(c, 1 - side, EPOLLRDHUP) < 0) return;
    }
    if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) pump(c, side, drain);
}

static void on_listener(struct listener *l) {
    for (int i = 0; i < ACCEPT_BATCH; i++) {
        int cfd = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (cfd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            return; /* EAGAIN; or EMFILE and the like: level-triggered, tried again */
        }
        int ufd = socket(l->backend.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (ufd < 0) {
            setsockopt(cfd, SOL_SOCKET, SO_LINGER, &rst, sizeof rst);
            close(cfd);
            continue;
        }
        setsockopt(ufd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (connect(ufd, (struct sockaddr *)&l->backend, l->backend_len) < 0 &&
            errno != EINPROGRESS) {
            close(ufd);
            setsockopt(cfd, SOL_SOCKET, SO_LINGER, &rst, sizeof rst);
            close(cfd);
            continue;
        }
        struct conn *c = malloc(sizeof *c);
        if (c == NULL) {
            close(ufd);
            close(cfd);
            continue;
        }
        c->fd[0] = cfd;
        c->fd[1] = ufd;
        c->connected = c->dead = 0;
        c->h[0].off = c->h[0].len = c->h[1].off = c->h[1].len = 0;
        c->h[0].eof = c->h[0].shut = c->h[1].eof = c->h[1].shut = 0;
        struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET};
        ev.data.u64 = (uintptr_t)c | TAG_CLIENT;
        int bad = epoll_ctl(ep, EPOLL_CTL_ADD, cfd, &ev);
        ev.data.u64 = (uintptr_t)c | TAG_BACKEND;
        bad |= epoll_ctl(ep, EPOLL_CTL_ADD, ufd, &ev);
        if (bad) close_conn(c, 1);
    }
}

int main(int argc, char **argv) {
    if (argc < 2 || argc - 1 > MAX_LISTENERS) {
        fprintf(stderr, "usage: relayfloor LISTEN=BACKEND... (at most %d)\n", MAX_LISTENERS);
        return 2;
    }
    ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) {
        perror("epoll_create1");
        return 1;
    }
    for (int i = 1; i < argc; i++) {
        char spec[160];
        snprintf(spec, sizeof spec, "%s", argv[i]);
        char *eq = strchr(spec, '=');
        struct sockaddr_storage front;
        socklen_t front_len;
        struct listener *l = &listeners[nlisteners];
        if (eq == NULL) goto bad_spec;
        *eq = 0;
        if (parse_addr(spec, &front, &front_len) || parse_addr(eq + 1, &l->backend,
                                                               &l->backend_len))
            goto bad_spec;
        l->fd = socket(front.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (l->fd < 0 || setsockopt(l->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) ||
            bind(l->fd, (struct sockaddr *)&front, front_len) || listen(l->fd, 4096)) {
            fprintf(stderr, "relayfloor: %s: %s\n", argv[i], strerror(errno));
            return 1;
        }
        struct epoll_event ev = {.events = EPOLLIN};
        ev.data.u64 = (uintptr_t)l | TAG_LISTENER;
        if (epoll_ctl(ep, EPOLL_CTL_ADD, l->fd, &ev)) {
            perror("epoll_ctl");
            return 1;
        }
        nlisteners++;
        continue;
    bad_spec:
        fprintf(stderr, "relayfloor: bad LISTEN=BACKEND: %s\n", argv[i]);
        return 2;
    }
    fprintf(stderr, "relayfloor: %d listeners\n", nlisteners);
    struct epoll_event events[MAX_EVENTS];
    for (;;) {
        int n = epoll_wait(ep, events, MAX_EVENTS, -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            perror("epoll_wait");
            return 1;
        }
        for (int i = 0; i < n; i++) {
            uint64_t data = events[i].data.u64;
            unsigned tag = (unsigned)(data & TAG_MASK);
            void *p = (void *)(uintptr_t)(data & ~(uint64_t)TAG_MASK);
            if (tag == TAG_LISTENER) on_listener(p);
            else on_conn(p, (int)tag, events[i].events);
        }
        while (dead != NULL) {
            struct conn *c = dead;
            dead = c->next_dead;
            free(c);
        }
    }
}
