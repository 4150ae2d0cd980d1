/* catlike: the reference implementation of the pbfix__catlike fixture.
 * catlike [-n] [FILE...]   ("-" or no FILE = stdin)
 * Copies bytes unchanged, writing whatever each read() returned right away (so it
 * streams through pipes), -n prefixes every line with "%6d\t" (numbering continues
 * across files). A missing file: message on stderr, go on, exit status 1. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int number_lines;
static long line_no;
static int at_line_start = 1;

static int write_all(const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = write(STDOUT_FILENO, buf, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

/* With -n, build the numbered form of one chunk; line state survives across chunks and files. */
static int emit(const char *buf, size_t len) {
    if (!number_lines) return write_all(buf, len);
    char prefix[32];
    size_t start = 0;
    for (size_t i = 0; i < len; i++) {
        if (at_line_start) {
            if (i > start && write_all(buf + start, i - start) < 0) return -1;
            start = i;
            int plen = snprintf(prefix, sizeof prefix, "%6ld\t", ++line_no);
            if (write_all(prefix, (size_t)plen) < 0) return -1;
            at_line_start = 0;
        }
        if (buf[i] == '\n') at_line_start = 1;
    }
    return write_all(buf + start, len - start);
}

static int copy_fd(int fd, const char *name) {
    char buf[65536];
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n == 0) return 0;
        if (n < 0) {
            if (errno == EINTR) continue;
            fprintf(stderr, "catlike: %s: %s\n", name, strerror(errno));
            return 1;
        }
        if (emit(buf, (size_t)n) < 0) {
            fprintf(stderr, "catlike: write error: %s\n", strerror(errno));
            exit(1);
        }
    }
}

int main(int argc, char **argv) {
    int i = 1, status = 0;
    for (; i < argc && argv[i][0] == '-' && argv[i][1] != '\0'; i++) {
        if (strcmp(argv[i], "--") == 0) { i++; break; }
        if (strcmp(argv[i], "-n") == 0) { number_lines = 1; continue; }
        fprintf(stderr, "catlike: invalid option '%s'\nusage: catlike [-n] [FILE...]\n", argv[i]);
        return 2;
    }
    if (i == argc) return copy_fd(STDIN_FILENO, "-");
    for (; i < argc; i++) {
        if (strcmp(argv[i], "-") == 0) {
            status |= copy_fd(STDIN_FILENO, "-");
            continue;
        }
        int fd = open(argv[i], O_RDONLY);
        if (fd < 0) {
            fprintf(stderr, "catlike: %s: %s\n", argv[i], strerror(errno));
            status = 1;
            continue;
        }
        status |= copy_fd(fd, argv[i]);
        close(fd);
    }
    return status;
}
