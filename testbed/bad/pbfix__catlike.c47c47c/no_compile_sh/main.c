/* bad variant `no_compile_sh`: a correct program, but the submission has no compile.sh. */
/* Known-good catlike, written from the docs (not from the reference). stdio output,
 * flushed after every chunk read, so pipes stream; memchr() walks lines for -n. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

struct numbering {
    int on;
    unsigned long next;
    int mid_line;
};

static void out_chunk(const char *p, size_t n, struct numbering *num) {
    if (!num->on) {
        fwrite(p, 1, n, stdout);
        return;
    }
    while (n > 0) {
        if (!num->mid_line) printf("%6lu\t", num->next++);
        const char *nl = memchr(p, '\n', n);
        size_t take = nl ? (size_t)(nl - p) + 1 : n;
        fwrite(p, 1, take, stdout);
        num->mid_line = nl == NULL;
        p += take;
        n -= take;
    }
}

static int pump(int fd, const char *label, struct numbering *num) {
    static char buf[1 << 15];
    ssize_t got;
    while ((got = read(fd, buf, sizeof buf)) != 0) {
        if (got < 0) {
            if (errno == EINTR) continue;
            fprintf(stderr, "catlike: %s: %s\n", label, strerror(errno));
            return 1;
        }
        out_chunk(buf, (size_t)got, num);
        fflush(stdout);
    }
    return 0;
}

int main(int argc, char **argv) {
    struct numbering num = {0, 1, 0};
    int opt;
    while ((opt = getopt(argc, argv, "n")) != -1) {
        if (opt != 'n') {
            fputs("usage: catlike [-n] [FILE...]\n", stderr);
            return 2;
        }
        num.on = 1;
    }
    if (optind == argc) return pump(0, "-", &num);
    int failed = 0;
    for (int i = optind; i < argc; i++) {
        int fd = strcmp(argv[i], "-") == 0 ? 0 : open(argv[i], O_RDONLY);
        if (fd < 0) {
            fprintf(stderr, "catlike: %s: %s\n", argv[i], strerror(errno));
            failed = 1;
            continue;
        }
        failed |= pump(fd, argv[i], &num);
        if (fd != 0) close(fd);
    }
    return failed;
}
