/* floor_safekeeper: a measurement tool for scripts/bench.py (configuration walsidecar-floor), not a safekeeper.
 *
 * The floor: what the sidecar achieves when a safekeeper costs nothing but recv/pwrite/fdatasync/send.
 * It speaks just enough of the safekeeper protocol (docs/protocol.md, sidecar/consensus/codec.py) over
 * plain TCP (the sidecar's --insecure), or TLS with --certs-dir (floor_wire.h), for one sidecar to elect a
 * term and stream: GreetingReply, a vote granted iff the term is new, ElectedReply with the divergence
 * point (the term's start on an empty store), then per batch of Appends one pwrite each, one fdatasync and
 * one AppendReply. WAL goes into PostgreSQL-named segment files, each renamed from a zero-filled spare a
 * thread prepares, as the real safekeeper does.
 *
 * What it skips, so never run it for anything but a measurement: the term and history live in memory only
 * (a restart forgets every promise), no control file, no record-boundary scan (tail_lsn 0: the proposer
 * skips its CRC check of the primary), no .partial names, no WAL removal, no certificate roles, auth-only,
 * InfoRequest, reader port, timeline switches or Refusal. Anything but the happy path closes the connection, and it
 * serves one connection at a time (a new one replaces the old). At SIGTERM it logs its fdatasync times.
 *
 * Build: gcc -O2 -pthread -o floor_safekeeper floor_safekeeper.c -lssl -lcrypto
 * Run:   floor_safekeeper --id N --listen 127.0.0.1:PORT --data-dir DIR [--certs-dir DIR]
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "floor_wire.h"

#define PROTOCOL_VERSION 5
#define FENCE 20 /* a TimelineFence (term, timeline, lsn) after the histories of VoteReply and Elected */
#define MAX_FRAME (16u * 1024 * 1024 + 1024)
#define RECV_BUF (2 * (size_t)MAX_FRAME + 64)
#define MAX_HISTORY 256
#define SYNC_EARLY (4u * 1024 * 1024) /* unsynced bytes that are synced before the socket is drained */

static const uint64_t MAX_TERM = (UINT64_C(1) << 63) - 1;

/* ---- state: in memory only */
static uint64_t node_id;
static const char *data_dir;
static int dir_fd = -1;
static uint32_t seg_size, timeline;
static uint64_t system_id;
static uint64_t term;                           /* the highest term promised */
static uint64_t hist_term[MAX_HISTORY], hist_start[MAX_HISTORY];
static uint32_t nhist;
static uint64_t elected_term;                   /* the term the current connection holds (0: none) */
static uint64_t write_lsn, flush_lsn, commit_lsn;
static int greeted;

/* ---- the segment being written, and the spare the thread keeps ready */
static int seg_fd = -1;
static uint64_t seg_no;
static pthread_mutex_t spare_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t spare_cv = PTHREAD_COND_INITIALIZER;
static int spare_ready, spare_wanted;

/* ---- what the log says at exit (SIGTERM): how long the disk took */
static volatile sig_atomic_t stopping;
static uint64_t syncs, sync_ns, sync_max_ns, appends, replies;

/* ---- the connection */
static SSL_CTX *tls_ctx; /* with --certs-dir */
static SSL *conn_ssl;
static int conn = -1;
static unsigned char *rbuf;
static size_t rstart, rend;
static unsigned char obuf[1 << 16];
static size_t oend;

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "floor_safekeeper %" PRIu64 ": ", node_id);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, ": %s\n", strerror(errno));
    va_end(ap);
    exit(1);
}

static void say(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "floor_safekeeper %" PRIu64 ": ", node_id);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* ---- storage */

static void write_all(int fd, const unsigned char *p, size_t n, off_t off) {
    while (n > 0) {
        ssize_t w = pwrite(fd, p, n, off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            die("pwrite");
        }
        p += w, n -= (size_t)w, off += w;
    }
}

static void zero_fill(int fd) {
    static unsigned char zeros[1 << 20];
    for (uint32_t off = 0; off < seg_size; off += sizeof zeros)
        write_all(fd, zeros, seg_size - off < sizeof zeros ? seg_size - off : sizeof zeros, off);
    if (fdatasync(fd) < 0)
        die("fdatasync of the spare");
}

static void *spare_maker(void *arg) {
    (void)arg;
    pthread_mutex_lock(&spare_mu);
    for (;;) {
        while (!spare_wanted)
            pthread_cond_wait(&spare_cv, &spare_mu);
        spare_wanted = 0;
        pthread_mutex_unlock(&spare_mu);
        int fd = openat(dir_fd, "wal.spare.tmp", O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0)
            die("creating wal.spare.tmp");
        zero_fill(fd);
        close(fd);
        /* Published under the lock that open_segment takes it under: spare_ready says wal.spare is there. */
        pthread_mutex_lock(&spare_mu);
        if (renameat(dir_fd, "wal.spare.tmp", dir_fd, "wal.spare") < 0)
            die("renaming wal.spare.tmp");
        spare_ready = 1;
    }
    return NULL;
}

static void want_spare(void) {
    pthread_mutex_lock(&spare_mu);
    spare_wanted = 1;
    pthread_cond_signal(&spare_cv);
    pthread_mutex_unlock(&spare_mu);
}

/* Make `no` the open segment: the old one is synced and closed, a new file is the spare renamed. */
static void open_segment(uint64_t no) {
    if (seg_fd >= 0 && seg_no == no)
        return;
    if (seg_fd >= 0) {
        if (fdatasync(seg_fd) < 0)
            die("fdatasync");
        close(seg_fd);
    }
    uint64_t per_id = (UINT64_C(1) << 32) / seg_size;
    char name[32];
    snprintf(name, sizeof name, "%08X%08X%08X", timeline, (uint32_t)(no / per_id), (uint32_t)(no % per_id));
    seg_fd = openat(dir_fd, name, O_RDWR);
    if (seg_fd < 0) {
        pthread_mutex_lock(&spare_mu);
        int ready = spare_ready;
        spare_ready = 0;
        if (ready && renameat(dir_fd, "wal.spare", dir_fd, name) < 0)
            die("renaming wal.spare to %s", name);
        pthread_mutex_unlock(&spare_mu);
        if (ready) {
            seg_fd = openat(dir_fd, name, O_RDWR);
        } else { /* the thread is still at it (or never was asked): zero-fill here */
            seg_fd = openat(dir_fd, name, O_RDWR | O_CREAT, 0600);
            if (seg_fd >= 0)
                zero_fill(seg_fd);
        }
        if (seg_fd < 0)
            die("opening %s", name);
        if (fsync(dir_fd) < 0)
            die("fsync of %s", data_dir);
        want_spare();
    }
    seg_no = no;
}

static void store(uint64_t lsn, const unsigned char *p, size_t n) {
    while (n > 0) {
        open_segment(lsn / seg_size);
        uint64_t off = lsn % seg_size;
        size_t part = seg_size - off < n ? (size_t)(seg_size - off) : n;
        write_all(seg_fd, p, part, (off_t)off);
        lsn += part, p += part, n -= part;
    }
}

/* ---- replies */

static int flush_out(void) {
    if (floor_write_all(conn, conn_ssl, obuf, oend) < 0) /* waits while the proposer does not read */
        return -1;
    oend = 0;
    return 0;
}

/* Room for a frame of `body` bytes after its length and tag; returns where the body goes. */
static unsigned char *frame(char tag, size_t body) {
    if (oend + 5 + body > sizeof obuf && flush_out() < 0)
        return NULL;
    unsigned char *p = put32(obuf + oend, (uint32_t)(body + 1));
    *p++ = (unsigned char)tag;
    oend += 5 + body;
    return p;
}

static int reply_append(void) {
    unsigned char *p = frame('A', 24);
    if (p == NULL)
        return -1;
    put64(put64(put64(p, term), flush_lsn), commit_lsn);
    return 0;
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static int sync_and_reply(void) {
    if (write_lsn > flush_lsn) {
        uint64_t began = now_ns();
        if (fdatasync(seg_fd) < 0)
            die("fdatasync");
        uint64_t took = now_ns() - began;
        syncs++, sync_ns += took;
        if (took > sync_max_ns)
            sync_max_ns = took;
        flush_lsn = write_lsn;
    }
    replies++;
    return reply_append();
}

static void on_term(int sig) {
    (void)sig;
    stopping = 1;
}

/* ---- messages: 0 handled, -1 close the connection */

static int on_greeting(const unsigned char *b, size_t n) {
    /* version, system id, timeline, segment size, major version, members (u16), then the proposer id */
    if (n < 28 || be32(b) != PROTOCOL_VERSION || n != 28 + ((size_t)b[26] << 8 | b[27]))
        return -1;
    uint64_t sys = be64(b + 4);
    uint32_t tli = be32(b + 12), seg = be32(b + 16);
    if (seg < (1u << 20) || (seg & (seg - 1)) || tli == 0)
        return -1;
    if (seg_size == 0)
        system_id = sys, seg_size = seg, timeline = tli;
    else if (sys != system_id || seg != seg_size)
        return -1;
    greeted = 1;
    unsigned char *p = frame('G', 18);
    if (p == NULL)
        return -1;
    p = put64(put64(p, node_id), term);
    p[0] = p[1] = 0; /* no reader port */
    return 0;
}

static int on_vote(const unsigned char *b, size_t n) {
    if (!greeted || n != 8)
        return -1;
    uint64_t t = be64(b);
    if (t > MAX_TERM)
        return -1;
    int granted = t > term;
    if (granted)
        term = t;
    uint32_t count = 0;
    while (count < nhist && hist_start[count] <= flush_lsn)
        count++;
    unsigned char *p = frame('V', 37 + 16 * (size_t)count + 4 + FENCE + 8);
    if (p == NULL)
        return -1;
    p = put64(p, term);
    *p++ = (unsigned char)granted;
    p = put64(p, flush_lsn);
    p = put64(p, 0); /* tail_lsn 0: no fingerprint, the proposer checks no CRC */
    p = put32(p, 0);
    p = put32(p, timeline);
    p = put32(p, count);
    for (uint32_t i = 0; i < count; i++)
        p = put64(put64(p, hist_term[i]), hist_start[i]);
    p = put32(p, 0); /* no timeline switches */
    memset(p, 0, FENCE + 8); /* no failover fence (this stand-in never takes part in a failover), no lost disk */
    return 0;
}

static int on_elected(const unsigned char *b, size_t n) {
    if (!greeted || n < 24)
        return -1;
    uint64_t t = be64(b), start = be64(b + 8);
    uint32_t tli = be32(b + 16), count = be32(b + 20);
    if (count == 0 || count > MAX_HISTORY || n != 24 + 16 * (size_t)count + 4 + FENCE
        || be32(b + 24 + 16 * (size_t)count) != 0 || be64(b + n - FENCE) != 0)
        return -1; /* a history this stand-in cannot keep, timeline switches or a failover's fence: not the happy path */
    if (t < term) {
        unsigned char *p = frame('E', 16);
        if (p == NULL)
            return -1;
        put64(put64(p, term), flush_lsn);
        return 0;
    }
    if (t > term || be64(b + 24 + 16 * (size_t)(count - 1)) != t || be64(b + 32 + 16 * (size_t)(count - 1)) != start)
        return -1;
    /* history.divergence_point: where this WAL and the proposer's history part ways */
    uint32_t mine = 0, common = 0;
    while (mine < nhist && hist_start[mine] <= flush_lsn)
        mine++;
    while (common < mine && common < count && hist_term[common] == be64(b + 24 + 16 * (size_t)common)) {
        if (hist_start[common] != be64(b + 32 + 16 * (size_t)common))
            return -1;
        common++;
    }
    uint64_t point;
    if (common == 0) {
        point = be64(b + 32);
    } else {
        uint64_t sk_next = common < mine ? hist_start[common] : flush_lsn;
        point = common < count && be64(b + 32 + 16 * (size_t)common) < sk_next ? be64(b + 32 + 16 * (size_t)common)
                                                                                : sk_next;
    }
    if (flush_lsn && flush_lsn < point)
        point = flush_lsn;
    if (point < commit_lsn && point < flush_lsn)
        return -1; /* acknowledged WAL is never cut */
    for (uint32_t i = 0; i < count; i++)
        hist_term[i] = be64(b + 24 + 16 * (size_t)i), hist_start[i] = be64(b + 32 + 16 * (size_t)i);
    nhist = count;
    if (tli)
        timeline = tli;
    if (commit_lsn > point)
        commit_lsn = point;
    write_lsn = flush_lsn = point;
    elected_term = t;
    if (seg_fd >= 0) { /* a new timeline names segments anew */
        close(seg_fd);
        seg_fd = -1;
    }
    open_segment(point / seg_size);
    say("elected in term %" PRIu64 ", WAL from %X/%X", t, (uint32_t)(point >> 32), (uint32_t)point);
    unsigned char *p = frame('E', 16);
    if (p == NULL)
        return -1;
    put64(put64(p, t), point);
    return 0;
}

/* 1: WAL or a heartbeat to acknowledge after the next sync, 0: answered, -1: close */
static int on_append(const unsigned char *b, size_t n) {
    if (n < 32)
        return -1;
    uint64_t t = be64(b), begin = be64(b + 8), commit = be64(b + 16);
    if (t < term) { /* a stale proposer learns our term */
        unsigned char *p = frame('A', 24);
        if (p == NULL)
            return -1;
        put64(put64(put64(p, term), flush_lsn), commit_lsn);
        return 0;
    }
    if (t != elected_term || begin != write_lsn)
        return -1;
    appends++;
    if (n > 32) {
        store(begin, b + 32, n - 32);
        write_lsn += n - 32;
    }
    uint64_t c = commit < write_lsn ? commit : write_lsn;
    if (c > commit_lsn)
        commit_lsn = c;
    return 1;
}

/* ---- the loop */

static void drop(const char *why) {
    if (conn < 0)
        return;
    say("connection closed: %s", why);
    SSL_free(conn_ssl);
    conn_ssl = NULL;
    close(conn);
    conn = -1;
    greeted = 0;      /* each connection greets first */
    elected_term = 0; /* only the connection that sent Elected appends */
}

/* Handle every whole frame received; sets *pending when WAL or a heartbeat waits for its reply. */
static int parse(int *pending) {
    while (rend - rstart >= 5) {
        uint32_t len = be32(rbuf + rstart);
        if (len == 0 || len > MAX_FRAME)
            return -1;
        if (rend - rstart < 4 + (size_t)len)
            break;
        const unsigned char *body = rbuf + rstart + 5;
        size_t n = len - 1;
        int rc;
        switch (rbuf[rstart + 4]) {
        case 'g': rc = on_greeting(body, n); break;
        case 'v': rc = on_vote(body, n); break;
        case 'e': rc = on_elected(body, n); break;
        case 'a': rc = on_append(body, n); break;
        default: rc = -1;
        }
        if (rc < 0)
            return -1;
        if (rc > 0)
            *pending = 1;
        rstart += 4 + (size_t)len;
    }
    if (rstart == rend) {
        rstart = rend = 0;
    } else if (RECV_BUF - rend < MAX_FRAME + 5) {
        memmove(rbuf, rbuf + rstart, rend - rstart);
        rend -= rstart;
        rstart = 0;
    }
    return 0;
}

/* Read until the socket is drained, then one fdatasync and one reply for all of it. */
static void serve(void) {
    int pending = 0;
    for (;;) {
        ssize_t r = floor_read(conn, conn_ssl, rbuf + rend, RECV_BUF - rend);
        if (r == 0) {
            drop("end of stream");
            return;
        }
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN) {
                drop(strerror(errno));
                return;
            }
            break;
        }
        rend += (size_t)r;
        if (parse(&pending) < 0) {
            drop("a message this stand-in does not handle");
            return;
        }
        if (pending && write_lsn - flush_lsn >= SYNC_EARLY) {
            if (sync_and_reply() < 0 || flush_out() < 0) {
                drop("send failed");
                return;
            }
            pending = 0;
        }
    }
    if ((pending && sync_and_reply() < 0) || flush_out() < 0)
        drop("send failed");
}

int main(int argc, char **argv) {
    const char *listen_at = NULL, *certs_dir = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--id"))
            node_id = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--listen"))
            listen_at = argv[i + 1];
        else if (!strcmp(argv[i], "--data-dir"))
            data_dir = argv[i + 1];
        else if (!strcmp(argv[i], "--certs-dir"))
            certs_dir = argv[i + 1];
    }
    const char *colon = listen_at ? strrchr(listen_at, ':') : NULL;
    if (!node_id || !data_dir || !colon) {
        fprintf(stderr, "usage: floor_safekeeper --id N --listen HOST:PORT --data-dir DIR [--certs-dir DIR]\n");
        return 2;
    }
    char why[600];
    if (certs_dir != NULL && (tls_ctx = floor_tls_context(certs_dir, 1, why, sizeof why)) == NULL) {
        fprintf(stderr, "floor_safekeeper: %s\n", why);
        return 2;
    }
    if (mkdir(data_dir, 0700) < 0 && errno != EEXIST)
        die("mkdir %s", data_dir);
    if ((dir_fd = open(data_dir, O_RDONLY | O_DIRECTORY)) < 0)
        die("opening %s", data_dir);
    if ((rbuf = malloc(RECV_BUF)) == NULL)
        die("malloc");
    signal(SIGPIPE, SIG_IGN);
    struct sigaction term_action = {.sa_handler = on_term};
    sigaction(SIGTERM, &term_action, NULL);
    sigset_t term_only, before;
    sigemptyset(&term_only);
    sigaddset(&term_only, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &term_only, &before); /* the thread inherits the mask: SIGTERM wakes poll() */
    pthread_t spare;
    if (pthread_create(&spare, NULL, spare_maker, NULL) != 0)
        die("pthread_create");
    pthread_sigmask(SIG_SETMASK, &before, NULL);

    char host[64];
    snprintf(host, sizeof host, "%.*s", (int)(colon - listen_at), listen_at);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) {
        fprintf(stderr, "floor_safekeeper: --listen takes an IPv4 address, not %s\n", host);
        return 2;
    }
    int one = 1, lfd = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(lfd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(lfd, 8) < 0)
        die("listening on %s", listen_at);
    say("listening on %s (a measurement stand-in: nothing is persisted but WAL)", listen_at);

    while (!stopping) {
        struct pollfd p[2] = {{lfd, POLLIN, 0}, {conn, POLLIN, 0}};
        if (poll(p, conn >= 0 ? 2 : 1, -1) < 0) {
            if (errno == EINTR)
                continue;
            die("poll");
        }
        if (p[0].revents & POLLIN) {
            int c = accept(lfd, NULL, NULL);
            if (c >= 0) {
                drop("a newer connection replaces it");
                setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                if (tls_ctx != NULL && (conn_ssl = floor_tls_start(tls_ctx, c, 1)) == NULL) {
                    say("TLS handshake failed: %s", ERR_reason_error_string(ERR_get_error()));
                    close(c);
                    continue;
                }
                conn = c;
                rstart = rend = oend = 0;
                continue;
            }
        }
        if (conn >= 0 && p[1].revents)
            serve();
    }
    say("stopped: %" PRIu64 " Appends, %" PRIu64 " replies, %" PRIu64 " fdatasyncs, mean %.0f us, max %.0f us",
        appends, replies, syncs, syncs ? sync_ns / 1e3 / (double)syncs : 0.0, sync_max_ns / 1e3);
    return 0;
}
