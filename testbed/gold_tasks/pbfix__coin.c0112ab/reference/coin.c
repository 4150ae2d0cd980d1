/* coin: prints its arguments joined by spaces; --version prints "coin 1.0". */
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "--version") == 0) {
        puts("coin 1.0");
        return 0;
    }
    for (int i = 1; i < argc; i++) printf("%s%s", i > 1 ? " " : "", argv[i]);
    putchar('\n');
    return 0;
}
