/* floor_wire.h: what scripts/bench.py's C stand-ins (floor_safekeeper.c, floor_proposer.c) share on the wire, a
 * measurement tool only: the protocol's big-endian fields, and the socket, plain or TLS. With a certificates
 * directory (ca.crt, node.crt, node.key, as `walsidecar certs` makes them) both ends speak TLS 1.3 through
 * OpenSSL, each requiring a certificate from the CA, as walsidecar's links do (sidecar/tls.py); what they
 * skip is the role in the certificate and the host name, which change what is trusted, not what a record
 * costs. Without one, plain TCP. The socket is non-blocking once connected: a read or write that would block
 * says EAGAIN, as recv/send with MSG_DONTWAIT do.
 */
#ifndef FLOOR_WIRE_H
#define FLOOR_WIRE_H

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <stdio.h>
#include <sys/socket.h>

/* Big-endian fields, as sidecar/consensus/codec.py packs them. */
static inline uint64_t be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | p[i];
    return v;
}

static inline uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static inline unsigned char *put64(unsigned char *p, uint64_t v) {
    for (int i = 7; i >= 0; i--, v >>= 8)
        p[i] = (unsigned char)v;
    return p + 8;
}

static inline unsigned char *put32(unsigned char *p, uint32_t v) {
    p[0] = v >> 24, p[1] = v >> 16, p[2] = v >> 8, p[3] = (unsigned char)v;
    return p + 4;
}

static inline unsigned char *put16(unsigned char *p, uint16_t v) {
    p[0] = v >> 8, p[1] = (unsigned char)v;
    return p + 2;
}

/* A context for `server` or client side from certificates directory `dir`; NULL with the reason in `why`. */
static inline SSL_CTX *floor_tls_context(const char *dir, int server, char *why, size_t why_len) {
    char ca[512], cert[512], key[512];
    snprintf(ca, sizeof ca, "%s/ca.crt", dir);
    snprintf(cert, sizeof cert, "%s/node.crt", dir);
    snprintf(key, sizeof key, "%s/node.key", dir);
    SSL_CTX *ctx = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
    if (ctx == NULL || !SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION)
        || SSL_CTX_load_verify_locations(ctx, ca, NULL) != 1 || SSL_CTX_use_certificate_chain_file(ctx, cert) != 1
        || SSL_CTX_use_PrivateKey_file(ctx, key, SSL_FILETYPE_PEM) != 1) {
        snprintf(why, why_len, "the certificates in %s: %s", dir, ERR_reason_error_string(ERR_get_error()));
        return NULL;
    }
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL);
    return ctx;
}

/* The handshake on connected socket `fd` (blocking until it is done), then the socket non-blocking. */
static inline SSL *floor_tls_start(SSL_CTX *ctx, int fd, int server) {
    SSL *ssl = SSL_new(ctx);
    if (ssl == NULL || SSL_set_fd(ssl, fd) != 1 || (server ? SSL_accept(ssl) : SSL_connect(ssl)) != 1) {
        SSL_free(ssl);
        return NULL;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    return ssl;
}

static inline ssize_t floor_tls_result(SSL *ssl, int r) {
    if (r > 0)
        return r;
    switch (SSL_get_error(ssl, r)) {
    case SSL_ERROR_WANT_READ:
    case SSL_ERROR_WANT_WRITE: errno = EAGAIN; return -1;
    case SSL_ERROR_ZERO_RETURN: return 0;
    default: errno = ECONNRESET; return -1;
    }
}

/* recv/send, through TLS when `ssl` is set: bytes, 0 at the end of the stream, -1 with errno (EAGAIN). */
static inline ssize_t floor_read(int fd, SSL *ssl, void *buf, size_t n) {
    if (ssl == NULL)
        return recv(fd, buf, n, MSG_DONTWAIT);
    return floor_tls_result(ssl, SSL_read(ssl, buf, n > INT32_MAX ? INT32_MAX : (int)n));
}

static inline ssize_t floor_write(int fd, SSL *ssl, const void *buf, size_t n) {
    if (ssl == NULL)
        return send(fd, buf, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    return floor_tls_result(ssl, SSL_write(ssl, buf, n > INT32_MAX ? INT32_MAX : (int)n));
}

/* All of `n` bytes, waiting for the socket as it must: 0, or -1 with errno. */
static inline int floor_write_all(int fd, SSL *ssl, const unsigned char *p, size_t n) {
    while (n > 0) {
        ssize_t w = floor_write(fd, ssl, p, n);
        if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
            struct pollfd pfd = {fd, POLLOUT, 0};
            poll(&pfd, 1, -1);
            continue;
        }
        if (w <= 0)
            return -1;
        p += w, n -= (size_t)w;
    }
    return 0;
}

/* Exactly `n` bytes, waiting for them: 0, or -1 at the end of the stream or an error. */
static inline int floor_read_exact(int fd, SSL *ssl, unsigned char *p, size_t n) {
    while (n > 0) {
        ssize_t r = floor_read(fd, ssl, p, n);
        if (r < 0 && (errno == EAGAIN || errno == EINTR)) {
            struct pollfd pfd = {fd, POLLIN, 0};
            poll(&pfd, 1, -1);
            continue;
        }
        if (r <= 0)
            return -1;
        p += r, n -= (size_t)r;
    }
    return 0;
}

#endif
