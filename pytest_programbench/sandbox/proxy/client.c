/* pb-proxy client: installed as /workspace/binary in a pytest-programbench sandbox.
 *
 * Hands the call to the root-owned proxy daemon (daemon.py) over a Unix socket: its stdin, stdout, stderr and
 * working directory travel as descriptors (SCM_RIGHTS), followed by rlimits, umask, signal dispositions, argv
 * (argv[0] as typed) and the environment. While the reference runs, the signals a user would send to it
 * (INT TERM HUP QUIT USR1 USR2 WINCH TSTP CONT) are forwarded as single bytes. The daemon answers with the exit
 * status, or the signal that killed the reference, and this program exits the same way.
 *
 * Built static (gcc -static -Os) so that a call costs well under a millisecond of client time.
 * Protocol constants must match daemon.py (HEADER, REPLY).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define DEFAULT_SOCKET "/run/pb-proxy/proxy.sock"
#define PROTOCOL_VERSION 1u
#define NLIMITS 16
#define REPLY_EXIT 0
#define REPLY_SIGNAL 1

extern char **environ;

struct __attribute__((packed)) request_header {
    char magic[4];
    uint32_t version, fdmask, flags, argc, envc, umask, nrlimits;
    uint64_t sig_ignored, sig_blocked;
    uint32_t strings_len, pad;
};

struct __attribute__((packed)) reply_header {
    char magic[4];
    int32_t kind, value;
    uint32_t message_len;
};

static const int forwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH, SIGTSTP, SIGCONT};
#define NFORWARDED (sizeof forwarded / sizeof forwarded[0])

static volatile sig_atomic_t pending[65];

static void on_signal(int sig) {
    if (sig > 0 && sig < 65) pending[sig] = 1;
}

static void fail(int code, const char *fmt, ...) __attribute__((noreturn, format(printf, 2, 3)));
static void fail(int code, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n > 0) {
        size_t len = (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1;
        ssize_t ignored = write(STDERR_FILENO, buf, len);
        (void)ignored;
    }
    _exit(code);
}

static int send_all(int sock, const void *data, size_t len) {
    const char *p = data;
    while (len > 0) {
        ssize_t n = send(sock, p, len, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int recv_all(int sock, void *data, size_t len) {
    char *p = data;
    while (len > 0) {
        ssize_t n = recv(sock, p, len, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (n == 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static void die_by_signal(int sig) __attribute__((noreturn));
static void die_by_signal(int sig) {
    struct rlimit nocore = {0, 0};
    setrlimit(RLIMIT_CORE, &nocore); /* the reference dumped no core; neither do we */
    signal(sig, SIG_DFL);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, sig);
    sigprocmask(SIG_UNBLOCK, &set, NULL);
    kill(getpid(), sig);
    _exit(128 + sig); /* a signal whose default action is not to terminate */
}

/* Stop ourselves the way the shell expects after telling the daemon to stop the reference. */
static void stop_self(const sigset_t *blocked) {
    signal(SIGTSTP, SIG_DFL);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTSTP);
    sigprocmask(SIG_UNBLOCK, &set, NULL);
    kill(getpid(), SIGTSTP);
    sigprocmask(SIG_SETMASK, blocked, NULL);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigfillset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGTSTP, &sa, NULL);
}

int main(int argc, char **argv) {
    const char *path = getenv("PB_PROXY_SOCKET");
    if (path == NULL || *path == '\0') path = DEFAULT_SOCKET;

    struct request_header h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, "PBX1", 4);
    h.version = PROTOCOL_VERSION;

    /* The caller's signal state, as the reference would have inherited it. */
    sigset_t original;
    sigprocmask(SIG_SETMASK, NULL, &original);
    for (int sig = 1; sig <= 64; sig++) {
        struct sigaction sa;
        if (sigaction(sig, NULL, &sa) == 0 && sa.sa_handler == SIG_IGN) h.sig_ignored |= 1ull << (sig - 1);
        if (sigismember(&original, sig) == 1) h.sig_blocked |= 1ull << (sig - 1);
    }
    mode_t mask = umask(022);
    umask(mask);
    h.umask = (uint32_t)mask;

    /* Descriptors: stdin, stdout, stderr (when open) and the working directory. */
    int fds[4];
    int nfds = 0;
    for (int fd = 0; fd < 3; fd++) {
        if (fcntl(fd, F_GETFD) != -1) {
            fds[nfds++] = fd;
            h.fdmask |= 1u << fd;
        }
    }
    int cwd = open(".", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (cwd < 0) cwd = open(".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (cwd >= 0) {
        fds[nfds++] = cwd;
        h.fdmask |= 8u;
    }

    /* Payload: rlimits, then argv and environ as NUL-terminated strings. */
    size_t envc = 0, strings = 0;
    for (int i = 0; i < argc; i++) strings += strlen(argv[i]) + 1;
    for (char **e = environ; e && *e; e++, envc++) strings += strlen(*e) + 1;
    size_t limits_len = NLIMITS * 16;
    char *payload = malloc(limits_len + strings + 1);
    if (payload == NULL) fail(126, "binary: out of memory\n");
    char *p = payload;
    for (int r = 0; r < NLIMITS; r++) {
        struct rlimit rl;
        uint64_t pair[2] = {UINT64_MAX, UINT64_MAX};
        if (getrlimit(r, &rl) == 0) {
            pair[0] = rl.rlim_cur == RLIM_INFINITY ? UINT64_MAX : (uint64_t)rl.rlim_cur;
            pair[1] = rl.rlim_max == RLIM_INFINITY ? UINT64_MAX : (uint64_t)rl.rlim_max;
        }
        memcpy(p, pair, 16);
        p += 16;
    }
    for (int i = 0; i < argc; i++) {
        size_t n = strlen(argv[i]) + 1;
        memcpy(p, argv[i], n);
        p += n;
    }
    for (char **e = environ; e && *e; e++) {
        size_t n = strlen(*e) + 1;
        memcpy(p, *e, n);
        p += n;
    }
    h.argc = (uint32_t)argc;
    h.envc = (uint32_t)envc;
    h.nrlimits = NLIMITS;
    h.strings_len = (uint32_t)strings;

    /* Block the forwarded signals until we wait for the reply (nothing is lost in between). */
    sigset_t blocked = original;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigfillset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (size_t i = 0; i < NFORWARDED; i++) {
        int sig = forwarded[i];
        if (h.sig_ignored >> (sig - 1) & 1) continue; /* the reference would ignore it too */
        sigaddset(&blocked, sig);
    }
    sigprocmask(SIG_SETMASK, &blocked, NULL);
    for (size_t i = 0; i < NFORWARDED; i++) {
        int sig = forwarded[i];
        if (h.sig_ignored >> (sig - 1) & 1) continue;
        sigaction(sig, &sa, NULL);
    }
    sigset_t waiting = blocked; /* during ppoll: the original mask, forwarded signals deliverable */
    for (size_t i = 0; i < NFORWARDED; i++)
        if (!sigismember(&original, forwarded[i])) sigdelset(&waiting, forwarded[i]);

    int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (sock < 0) fail(126, "binary: socket: %s\n", strerror(errno));
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof addr.sun_path) fail(126, "binary: socket path too long: %s\n", path);
    strcpy(addr.sun_path, path);
    while (connect(sock, (struct sockaddr *)&addr, sizeof addr) < 0) {
        if (errno == EINTR) continue;
        fail(126, "binary: the reference proxy is not running (%s: %s)\n", path, strerror(errno));
    }

    struct iovec iov = {&h, sizeof h};
    union {
        char buf[CMSG_SPACE(sizeof(int) * 4)];
        struct cmsghdr align;
    } control;
    memset(&control, 0, sizeof control);
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (nfds > 0) {
        msg.msg_control = control.buf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
    }
    /* A send error is reported only if no reply explains it: the daemon answers a refused caller at once and
     * closes, so the rest of our request meets a closed socket while the refusal waits to be read. */
    int send_error = 0;
    ssize_t sent;
    do sent = sendmsg(sock, &msg, MSG_NOSIGNAL);
    while (sent < 0 && errno == EINTR);
    if (sent < 0) send_error = errno;
    else if ((size_t)sent < sizeof h && send_all(sock, (char *)&h + sent, sizeof h - (size_t)sent) < 0)
        send_error = errno;
    if (!send_error && send_all(sock, payload, (size_t)(p - payload)) < 0) send_error = errno;
    free(payload);
    if (cwd >= 0) close(cwd);

    for (;;) {
        struct pollfd pfd = {sock, POLLIN, 0};
        int r = ppoll(&pfd, 1, NULL, &waiting);
        if (r < 0 && errno != EINTR) fail(125, "binary: poll: %s\n", strerror(errno));
        for (int sig = 1; sig < 65; sig++) {
            if (!pending[sig]) continue;
            pending[sig] = 0;
            unsigned char byte = (unsigned char)sig;
            (void)send_all(sock, &byte, 1);
            if (sig == SIGTSTP) stop_self(&blocked);
        }
        if (r > 0) break;
    }

    struct reply_header reply;
    if (recv_all(sock, &reply, sizeof reply) < 0 || memcmp(reply.magic, "PBR1", 4) != 0) {
        if (send_error) fail(126, "binary: cannot reach the reference proxy: %s\n", strerror(send_error));
        fail(125, "binary: the reference proxy closed the connection without a result\n");
    }
    if (reply.message_len > 0) {
        char message[4097];
        uint32_t len = reply.message_len > 4096 ? 4096 : reply.message_len;
        if (recv_all(sock, message, len) == 0) {
            ssize_t ignored = write(STDERR_FILENO, message, len);
            (void)ignored;
        }
    }
    if (reply.kind == REPLY_SIGNAL) die_by_signal(reply.value);
    _exit(reply.value & 0xff);
}
