/* bad variant `compile_error`: does not compile (gcc fails, so no ./executable). */
#include <stdio.h>
int main(void) {
    printf("%s\n", undeclared_name)
}
