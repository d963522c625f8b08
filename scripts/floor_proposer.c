/* floor_proposer: a measurement tool for scripts/bench.py (configuration walsidecar-floor-all), not a proposer.
 *
 * The sidecar's floor: what a commit costs when the proposer costs nothing but the system calls of its
 * pump, one read of the primary's COPY stream, one write of an Append to each safekeeper, one read of each
 * AppendReply, one standby status to the primary. It runs in the sidecar's place against three
 * scripts/floor_safekeeper.c, over plain TCP or, with --certs-dir, TLS (floor_wire.h): greets them, asks
 * for the votes of a new term, sends Elected with a history of that term alone starting at the primary's
 * flush position, then streams: everything drained from the primary in one pass as one Append per
 * safekeeper (one write, or one TLS record, each), and the quorum of their flush positions (the majority's,
 * as consensus/quorum.py says for members that are all in one term) as the standby status's flush, as soon
 * as it moves.
 *
 * What it skips, so never run it for anything but a measurement: no certificate roles, no slot, no recovery,
 * no catch-up (a safekeeper that disconnects is gone for good), no term kept anywhere, no check of the
 * primary's WAL, no timeline switch. Anything off the happy path ends the process. At SIGTERM it logs what it relayed.
 *
 * Build: gcc -O2 -I$(pg_config --includedir) -o floor_proposer floor_proposer.c -lpq -lssl -lcrypto
 * Run:   floor_proposer --pg-dsn DSN --application-name NAME --safekeepers HOST:PORT,... [--certs-dir DIR]
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <libpq-fe.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "floor_wire.h"

#define PROTOCOL_VERSION 5
#define FENCE 20 /* a TimelineFence (term, timeline, lsn): none */
#define MAX_SK 7
#define REPLY_BUF 4096
#define BATCH_MAX (16u * 1024 * 1024) /* an Append's data at most (codec.MAX_APPEND_DATA's order) */
#define APPEND_HEADER 37             /* length, tag, term, begin_lsn, commit_lsn, peer_horizon_lsn */
#define PG_EPOCH_OFFSET_US INT64_C(946684800000000) /* 2000-01-01 in Unix microseconds */

static volatile sig_atomic_t stopping;
static PGconn *pg;
static int nsk, sk_fd[MAX_SK];
static SSL *sk_ssl[MAX_SK];
static unsigned char sk_buf[MAX_SK][REPLY_BUF];
static size_t sk_len[MAX_SK];
static uint64_t sk_flush[MAX_SK];
static uint64_t term, received_lsn, reported_flush;
static unsigned char *batch; /* an Append frame: its header, then the WAL */
static size_t batch_len;
static uint64_t batch_start;
static uint64_t batches, statuses, replies_read;

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "floor_proposer: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static void send_all(int i, const unsigned char *p, size_t n) {
    if (floor_write_all(sk_fd[i], sk_ssl[i], p, n) < 0)
        die("writing to safekeeper %d: %s", i + 1, strerror(errno));
}

/* Wait for one whole frame from safekeeper `i`: its tag, and its body in `body` (at most `cap`). */
static char read_frame(int i, unsigned char *body, size_t cap, size_t *n) {
    unsigned char head[5];
    if (floor_read_exact(sk_fd[i], sk_ssl[i], head, 5) < 0)
        die("safekeeper %d closed during the election", i + 1);
    uint32_t len = be32(head);
    if (len < 1 || len - 1 > cap)
        die("safekeeper %d sent a frame of %u bytes during the election", i + 1, len);
    *n = len - 1;
    if (floor_read_exact(sk_fd[i], sk_ssl[i], body, *n) < 0)
        die("safekeeper %d closed during the election", i + 1);
    return (char)head[4];
}

static int connect_to(const char *address) {
    const char *colon = strrchr(address, ':');
    if (colon == NULL)
        die("a safekeeper address is HOST:PORT, not %s", address);
    char host[64];
    snprintf(host, sizeof host, "%.*s", (int)(colon - address), address);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1)
        die("--safekeepers takes IPv4 addresses, not %s", host);
    for (int attempt = 0;; attempt++) { /* the stand-ins start beside this process */
        int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) {
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            return fd;
        }
        close(fd);
        if (attempt == 600)
            die("cannot connect to %s: %s", address, strerror(errno));
        usleep(50000);
    }
}

static PGresult *command(const char *sql, ExecStatusType want) {
    PGresult *r = PQexec(pg, sql);
    if (PQresultStatus(r) != want)
        die("%s: %s", sql, PQerrorMessage(pg));
    return r;
}

static uint32_t segment_size(void) {
    PGresult *r = command("SHOW wal_segment_size", PGRES_TUPLES_OK);
    char unit[8] = "";
    unsigned long v = 0;
    if (sscanf(PQgetvalue(r, 0, 0), "%lu%7s", &v, unit) < 1)
        die("wal_segment_size %s", PQgetvalue(r, 0, 0));
    PQclear(r);
    if (!strcmp(unit, "kB"))
        v <<= 10;
    else if (!strcmp(unit, "MB"))
        v <<= 20;
    else if (!strcmp(unit, "GB"))
        v <<= 30;
    return (uint32_t)v;
}

/* Greeting, VoteRequest, Elected on every safekeeper: a new term whose history starts at `start`. */
static void elect(uint64_t system_id, uint32_t tli, uint32_t seg, uint64_t start) {
    static const char id[] = "floor-proposer";
    unsigned char out[256], in[REPLY_BUF], *p;
    size_t n;
    uint64_t highest = 0;
    for (int i = 0; i < nsk; i++) {
        p = out + 4;
        *p++ = 'g';
        p = put32(p, PROTOCOL_VERSION);
        p = put64(p, system_id);
        p = put32(p, tli);
        p = put32(p, seg);
        p = put32(p, (uint32_t)PQserverVersion(pg));
        p = put16(p, (uint16_t)nsk);
        p = put16(p, (uint16_t)(sizeof id - 1));
        memcpy(p, id, sizeof id - 1), p += sizeof id - 1;
        put32(out, (uint32_t)(p - out - 4));
        send_all(i, out, (size_t)(p - out));
        if (read_frame(i, in, sizeof in, &n) != 'G' || n < 16)
            die("safekeeper %d did not answer the greeting", i + 1);
        if (be64(in + 8) > highest)
            highest = be64(in + 8);
    }
    term = highest + 1;
    for (int i = 0; i < nsk; i++) {
        p = put32(out, 9);
        *p++ = 'v';
        p = put64(p, term);
        send_all(i, out, (size_t)(p - out));
        if (read_frame(i, in, sizeof in, &n) != 'V' || n < 9 || in[8] != 1)
            die("safekeeper %d did not grant term %" PRIu64, i + 1, term);
    }
    for (int i = 0; i < nsk; i++) {
        p = out + 4;
        *p++ = 'e';
        p = put64(p, term);
        p = put64(p, start);
        p = put32(p, tli);
        p = put32(p, 1);
        p = put64(p, term);
        p = put64(p, start);
        p = put32(p, 0); /* no timeline switches */
        memset(p, 0, FENCE), p += FENCE;
        put32(out, (uint32_t)(p - out - 4));
        send_all(i, out, (size_t)(p - out));
        if (read_frame(i, in, sizeof in, &n) != 'E' || n != 16 || be64(in) != term || be64(in + 8) != start)
            die("safekeeper %d did not take term %" PRIu64 " from %X/%X", i + 1, term, (uint32_t)(start >> 32),
                (uint32_t)start);
        sk_flush[i] = start;
    }
}

/* The position a majority has flushed: the (nsk/2+1)-th highest. */
static uint64_t quorum_flush(void) {
    uint64_t v[MAX_SK];
    memcpy(v, sk_flush, sizeof v);
    for (int i = 1; i < nsk; i++) /* insertion sort, descending: a handful of values */
        for (int j = i; j > 0 && v[j] > v[j - 1]; j--) {
            uint64_t t = v[j];
            v[j] = v[j - 1], v[j - 1] = t;
        }
    return v[nsk / 2];
}

/* A standby status with the positions now: sent whole before it returns, as a commit waits for it. */
static void send_status(void) {
    unsigned char m[34], *p = m;
    struct timeval tv;
    gettimeofday(&tv, NULL);
    int64_t now = (int64_t)tv.tv_sec * 1000000 + tv.tv_usec - PG_EPOCH_OFFSET_US;
    *p++ = 'r';
    p = put64(p, received_lsn);
    p = put64(p, reported_flush);
    p = put64(p, reported_flush);
    p = put64(p, (uint64_t)now);
    *p = 0; /* no reply requested */
    if (PQputCopyData(pg, (const char *)m, sizeof m) != 1)
        die("sending the status: %s", PQerrorMessage(pg));
    int left;
    while ((left = PQflush(pg)) == 1) {
        struct pollfd pfd = {PQsocket(pg), POLLOUT, 0};
        poll(&pfd, 1, -1);
    }
    if (left < 0)
        die("sending the status: %s", PQerrorMessage(pg));
    statuses++;
}

/* The batch as one Append to every safekeeper. */
static void send_batch(void) {
    unsigned char *p = put32(batch, (uint32_t)(APPEND_HEADER - 4 + batch_len));
    *p++ = 'a';
    p = put64(p, term);
    p = put64(p, batch_start);
    p = put64(p, reported_flush);
    put64(p, 0);
    for (int i = 0; i < nsk; i++) /* waits: a safekeeper that stops reading stops this relay, as it may */
        send_all(i, batch, APPEND_HEADER + batch_len);
    batch_len = 0;
    batches++;
}

/* Everything libpq has from the primary: XLogData into the batch, keepalives answered. */
static void drain_primary(void) {
    if (!PQconsumeInput(pg))
        die("reading from the primary: %s", PQerrorMessage(pg));
    int answer = 0;
    for (;;) {
        char *buf;
        int n = PQgetCopyData(pg, &buf, 1);
        if (n == 0)
            break;
        if (n == -1) { /* the primary ended COPY: it is shutting down */
            stopping = 1;
            break;
        }
        if (n < 0)
            die("reading the primary's stream: %s", PQerrorMessage(pg));
        if (buf[0] == 'w' && n >= 25) {
            uint64_t start = be64((unsigned char *)buf + 1);
            size_t len = (size_t)n - 25;
            if (start != received_lsn)
                die("WAL at %X/%X, expected %X/%X", (uint32_t)(start >> 32), (uint32_t)start,
                    (uint32_t)(received_lsn >> 32), (uint32_t)received_lsn);
            if (len > BATCH_MAX)
                die("an XLogData of %zu bytes", len);
            if (batch_len + len > BATCH_MAX)
                send_batch();
            if (batch_len == 0)
                batch_start = start;
            memcpy(batch + APPEND_HEADER + batch_len, buf + 25, len);
            batch_len += len;
            received_lsn += len;
        } else if (buf[0] == 'k' && n >= 18) {
            answer |= buf[17];
        } else {
            die("an unexpected message '%c' from the primary", buf[0]);
        }
        PQfreemem(buf);
    }
    if (batch_len)
        send_batch();
    if (answer)
        send_status();
}

/* The whole AppendReplies received from safekeeper `i`: its flush position. */
static void take_replies(int i) {
    size_t at = 0;
    while (sk_len[i] - at >= 5) {
        uint32_t len = be32(sk_buf[i] + at);
        if (len < 1 || len > REPLY_BUF - 4)
            die("safekeeper %d sent a frame of %u bytes", i + 1, len);
        if (sk_len[i] - at < 4 + (size_t)len)
            break;
        const unsigned char *body = sk_buf[i] + at + 5;
        if (sk_buf[i][at + 4] != 'A' || len != 25 || be64(body) != term)
            die("safekeeper %d sent something but an AppendReply in term %" PRIu64, i + 1, term);
        if (be64(body + 8) > sk_flush[i])
            sk_flush[i] = be64(body + 8);
        replies_read++;
        at += 4 + (size_t)len;
    }
    memmove(sk_buf[i], sk_buf[i] + at, sk_len[i] - at);
    sk_len[i] -= at;
}

/* What safekeeper `i` sent, and what TLS holds decrypted of it, which poll() cannot see. */
static void read_replies(int i) {
    for (;;) {
        ssize_t r = floor_read(sk_fd[i], sk_ssl[i], sk_buf[i] + sk_len[i], REPLY_BUF - sk_len[i]);
        if (r == 0)
            die("safekeeper %d closed the connection", i + 1);
        if (r < 0) {
            if (errno == EAGAIN || errno == EINTR)
                return;
            die("reading from safekeeper %d: %s", i + 1, strerror(errno));
        }
        sk_len[i] += (size_t)r;
        take_replies(i);
        if (sk_ssl[i] == NULL || SSL_pending(sk_ssl[i]) == 0)
            return; /* poll() sees the rest */
    }
}

static void on_term(int sig) {
    (void)sig;
    stopping = 1;
}

int main(int argc, char **argv) {
    const char *dsn = NULL, *app = NULL, *sks = NULL, *certs_dir = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--pg-dsn"))
            dsn = argv[i + 1];
        else if (!strcmp(argv[i], "--application-name"))
            app = argv[i + 1];
        else if (!strcmp(argv[i], "--safekeepers"))
            sks = argv[i + 1];
        else if (!strcmp(argv[i], "--certs-dir"))
            certs_dir = argv[i + 1];
    }
    if (!dsn || !app || !sks) {
        fprintf(stderr, "usage: floor_proposer --pg-dsn DSN --application-name NAME --safekeepers HOST:PORT,... "
                        "[--certs-dir DIR]\n");
        return 2;
    }
    char why[600];
    SSL_CTX *tls_ctx = NULL;
    if (certs_dir != NULL && (tls_ctx = floor_tls_context(certs_dir, 0, why, sizeof why)) == NULL)
        die("%s", why);
    signal(SIGPIPE, SIG_IGN);
    struct sigaction term_action = {.sa_handler = on_term};
    sigaction(SIGTERM, &term_action, NULL);
    sigaction(SIGINT, &term_action, NULL);
    if ((batch = malloc(APPEND_HEADER + BATCH_MAX)) == NULL)
        die("malloc");

    const char *keys[] = {"dbname", "replication", "application_name", NULL};
    const char *values[] = {dsn, "true", app, NULL};
    pg = PQconnectdbParams(keys, values, 1);
    if (PQstatus(pg) != CONNECTION_OK)
        die("connecting to the primary: %s", PQerrorMessage(pg));
    PGresult *r = command("IDENTIFY_SYSTEM", PGRES_TUPLES_OK);
    uint64_t system_id = strtoull(PQgetvalue(r, 0, 0), NULL, 10);
    uint32_t tli = (uint32_t)strtoul(PQgetvalue(r, 0, 1), NULL, 10), hi, lo;
    if (sscanf(PQgetvalue(r, 0, 2), "%X/%X", &hi, &lo) != 2)
        die("IDENTIFY_SYSTEM's xlogpos %s", PQgetvalue(r, 0, 2));
    PQclear(r);
    uint64_t start = (uint64_t)hi << 32 | lo;
    uint32_t seg = segment_size();

    char *list = strdup(sks), *save = NULL;
    for (char *a = strtok_r(list, ",", &save); a != NULL; a = strtok_r(NULL, ",", &save)) {
        if (nsk == MAX_SK)
            die("at most %d safekeepers", MAX_SK);
        sk_fd[nsk] = connect_to(a);
        if (tls_ctx != NULL && (sk_ssl[nsk] = floor_tls_start(tls_ctx, sk_fd[nsk], 0)) == NULL)
            die("TLS handshake with %s: %s", a, ERR_reason_error_string(ERR_get_error()));
        nsk++;
    }
    elect(system_id, tli, seg, start);
    received_lsn = reported_flush = start;

    char cmd[128];
    snprintf(cmd, sizeof cmd, "START_REPLICATION PHYSICAL %X/%X TIMELINE %u", (uint32_t)(start >> 32),
             (uint32_t)start, tli);
    PQclear(command(cmd, PGRES_COPY_BOTH));
    if (PQsetnonblocking(pg, 1) != 0)
        die("PQsetnonblocking: %s", PQerrorMessage(pg));
    fprintf(stderr, "floor_proposer: streaming in term %" PRIu64 " from %X/%X to %d safekeepers\n", term,
            (uint32_t)(start >> 32), (uint32_t)start, nsk);

    struct pollfd fds[1 + MAX_SK];
    fds[0] = (struct pollfd){PQsocket(pg), POLLIN, 0};
    for (int i = 0; i < nsk; i++)
        fds[1 + i] = (struct pollfd){sk_fd[i], POLLIN, 0};
    send_status(); /* the walsender counts a standby as synchronous once it has reported a flush position */
    drain_primary(); /* what came with the CopyBothResponse */
    while (!stopping) {
        if (poll(fds, (nfds_t)(1 + nsk), 1000) < 0) {
            if (errno == EINTR)
                continue;
            die("poll: %s", strerror(errno));
        }
        if (fds[0].revents)
            drain_primary();
        for (int i = 0; i < nsk; i++)
            if (fds[1 + i].revents)
                read_replies(i);
        uint64_t q = quorum_flush();
        if (q > reported_flush) {
            reported_flush = q;
            send_status();
        }
    }
    fprintf(stderr, "floor_proposer: stopped: %" PRIu64 " batches, %" PRIu64 " replies, %" PRIu64 " statuses\n",
            batches, replies_read, statuses);
    for (int i = 0; i < nsk; i++)
        if (sk_ssl[i] != NULL)
            SSL_shutdown(sk_ssl[i]); /* the stand-in safekeepers see the end of the stream, not a reset */
    PQfinish(pg);
    return 0;
}
