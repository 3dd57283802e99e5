/* nfq-floor: the floor of any NFQUEUE design on this machine (kpx bench, issue 15).
 *
 * Binds an NFQUEUE and answers every queued IPv4 packet NF_ACCEPT with a mark chosen
 * round robin from those given for its TCP destination port, keeping the packet's own
 * bits outside MASK; a packet for any other port is dropped. The bench runs it on
 * kpx-nfq's own rules and DNAT maps, in place of kpx: what kpx-nfq pays beyond it is its
 * Python's (reading, deciding, answering), and what this pays beyond kernel DNAT is the
 * queue's (a wake-up, two copies through netlink, the reinjection).
 *
 * The same batches as kpx's reader: one blocking recv, then non-blocking ones until
 * EAGAIN (at most 64), then every verdict in one datagram.
 *
 * usage: nfqfloor QUEUE MASK PORT=MARK[,MARK...]...
 */
#include <arpa/inet.h>
#include <errno.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_queue.h>
#include <linux/netlink.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_PORTS 16
#define MAX_MARKS 64

struct port { uint16_t port; int n; unsigned next; uint32_t marks[MAX_MARKS]; };

static struct port ports[MAX_PORTS];
static int nports;
static int fd;
static uint16_t queue;

static size_t put_attr(char *p, uint16_t type, const void *data, uint16_t len) {
    struct nlattr *a = (struct nlattr *)p;
    a->nla_len = NLA_HDRLEN + len;
    a->nla_type = type;
    memcpy(p + NLA_HDRLEN, data, len);
    return NLA_ALIGN(a->nla_len);
}

static size_t put_header(char *p, uint16_t type, uint16_t flags) {
    struct nlmsghdr *h = (struct nlmsghdr *)p;
    memset(h, 0, NLMSG_HDRLEN);
    h->nlmsg_type = (NFNL_SUBSYS_QUEUE << 8) | type;
    h->nlmsg_flags = flags;
    struct nfgenmsg *g = (struct nfgenmsg *)(p + NLMSG_HDRLEN);
    g->nfgen_family = AF_UNSPEC;
    g->version = NFNETLINK_V0;
    g->res_id = htons(queue);
    return NLMSG_HDRLEN + NLMSG_ALIGN(sizeof(struct nfgenmsg));
}

/* Send one config request and wait for the kernel's answer: 0, or its errno. Asked for
 * (NLM_F_ACK), so a refused bind is an error here, not a reader that silently gets no
 * packet. Nothing is queued to us before the bind, so the next message is the answer. */
static int request(const char *buf, size_t n, const char *what) {
    if (send(fd, buf, n, 0) < 0) { perror(what); exit(1); }
    char in[512];
    ssize_t got = recv(fd, in, sizeof in, 0);
    if (got < (ssize_t)NLMSG_HDRLEN) { perror(what); exit(1); }
    const struct nlmsghdr *h = (const struct nlmsghdr *)in;
    if (h->nlmsg_type != NLMSG_ERROR) return 0;
    return -((const struct nlmsgerr *)NLMSG_DATA(h))->error;
}

/* Bind the queue, retrying for up to 5 s while another socket still has it (EPERM: a
 * process being replaced; EBUSY), then set the copy range and the queue's length. */
static void configure(void) {
    char buf[128];
    size_t n = put_header(buf, NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK);
    struct nfqnl_msg_config_cmd cmd = {.command = NFQNL_CFG_CMD_BIND, .pf = htons(AF_INET)};
    n += put_attr(buf + n, NFQA_CFG_CMD, &cmd, sizeof cmd);
    ((struct nlmsghdr *)buf)->nlmsg_len = n;
    int err;
    for (int tries = 0; (err = request(buf, n, "nfqfloor: bind")) != 0; tries++) {
        if ((err != EPERM && err != EBUSY) || tries == 100) {
            fprintf(stderr, "nfqfloor: bind queue %u: %s\n", queue, strerror(err));
            exit(1);
        }
        usleep(50000);
    }
    n = put_header(buf, NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK);
    struct nfqnl_msg_config_params params = {.copy_range = htonl(80),
                                              .copy_mode = NFQNL_COPY_PACKET};
    n += put_attr(buf + n, NFQA_CFG_PARAMS, &params, sizeof params);
    uint32_t maxlen = htonl(4096);
    n += put_attr(buf + n, NFQA_CFG_QUEUE_MAXLEN, &maxlen, sizeof maxlen);
    ((struct nlmsghdr *)buf)->nlmsg_len = n;
    if ((err = request(buf, n, "nfqfloor: params")) != 0) {
        fprintf(stderr, "nfqfloor: queue %u params: %s\n", queue, strerror(err));
        exit(1);
    }
}

/* The mark for an IPv4 packet's TCP destination port; 0: none of ours. */
static uint32_t choose(const uint8_t *ip, size_t len) {
    if (len < 20 || ip[0] >> 4 != 4 || ip[9] != IPPROTO_TCP) return 0;
    size_t ihl = (size_t)(ip[0] & 0x0f) * 4;
    if (len < ihl + 4) return 0;
    uint16_t dport = (uint16_t)(ip[ihl + 2] << 8 | ip[ihl + 3]);
    for (int i = 0; i < nports; i++)
        if (ports[i].port == dport) return ports[i].marks[ports[i].next++ % ports[i].n];
    return 0;
}

static void parse_args(int argc, char **argv) {
    for (int i = 3; i < argc && nports < MAX_PORTS; i++) {
        struct port *p = &ports[nports++];
        char *rest;
        p->port = (uint16_t)strtoul(argv[i], &rest, 10);
        while (*rest == '=' || *rest == ',') {
            if (p->n == MAX_MARKS) break;
            p->marks[p->n++] = (uint32_t)strtoul(rest + 1, &rest, 0);
        }
        if (p->n == 0) { fprintf(stderr, "nfqfloor: %s: no mark\n", argv[i]); exit(2); }
    }
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: nfqfloor QUEUE MASK PORT=MARK[,MARK...]...\n");
        return 2;
    }
    queue = (uint16_t)strtoul(argv[1], NULL, 0);
    uint32_t mask = (uint32_t)strtoul(argv[2], NULL, 0);
    parse_args(argc, argv);
    fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_NETFILTER);
    struct sockaddr_nl self = {.nl_family = AF_NETLINK};
    if (fd < 0 || bind(fd, (struct sockaddr *)&self, sizeof self) < 0) {
        perror("nfqfloor: socket");
        return 1;
    }
    int size = 8 << 20, one = 1;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &size, sizeof size);
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);
    configure();
    fprintf(stderr, "nfqfloor: queue %u bound, %d port(s)\n", queue, nports);
    static char in[1 << 16], out[1 << 16];
    for (;;) {
        size_t used = 0;
        int flags = 0;
        for (int reads = 0; reads < 64; reads++, flags = MSG_DONTWAIT) {
            ssize_t got = recv(fd, in, sizeof in, flags);
            if (got < 0) {
                if (errno == EAGAIN || errno == EINTR) break;
                perror("nfqfloor: recv");
                return 1;
            }
            int left = (int)got;
            for (struct nlmsghdr *h = (struct nlmsghdr *)in; NLMSG_OK(h, left);
                 h = NLMSG_NEXT(h, left)) {
                if ((h->nlmsg_type & 0xff) != NFQNL_MSG_PACKET) continue;
                uint32_t id = 0, packet_mark = 0, mark = 0;
                int have_id = 0;
                char *p = (char *)NLMSG_DATA(h) + NLMSG_ALIGN(sizeof(struct nfgenmsg));
                char *end = (char *)h + h->nlmsg_len;
                while (p + NLA_HDRLEN <= end) {
                    struct nlattr *a = (struct nlattr *)p;
                    if (a->nla_len < NLA_HDRLEN || p + a->nla_len > end) break;
                    const uint8_t *v = (const uint8_t *)p + NLA_HDRLEN;
                    size_t vlen = a->nla_len - NLA_HDRLEN;
                    switch (a->nla_type & NLA_TYPE_MASK) {
                    case NFQA_PACKET_HDR:
                        id = ntohl(((const struct nfqnl_msg_packet_hdr *)v)->packet_id);
                        have_id = 1;
                        break;
                    case NFQA_MARK: packet_mark = ntohl(*(const uint32_t *)v); break;
                    case NFQA_PAYLOAD: mark = choose(v, vlen); break;
                    }
                    p += NLA_ALIGN(a->nla_len);
                }
                if (!have_id) continue;
                size_t start = used;
                used += put_header(out + used, NFQNL_MSG_VERDICT, NLM_F_REQUEST);
                struct nfqnl_msg_verdict_hdr vh = {.verdict = htonl(mark ? NF_ACCEPT : NF_DROP),
                                                   .id = htonl(id)};
                used += put_attr(out + used, NFQA_VERDICT_HDR, &vh, sizeof vh);
                if (mark) {
                    uint32_t m = htonl((packet_mark & ~mask) | mark);
                    used += put_attr(out + used, NFQA_MARK, &m, sizeof m);
                }
                ((struct nlmsghdr *)(out + start))->nlmsg_len = (uint32_t)(used - start);
                if (used > sizeof out - 128) {
                    send(fd, out, used, 0);
                    used = 0;
                }
            }
        }
        if (used) send(fd, out, used, 0);
    }
}
