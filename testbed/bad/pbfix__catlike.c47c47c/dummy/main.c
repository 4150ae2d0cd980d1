/* bad variant `dummy`: prints nothing at all, exits 0. */
int main(void) { return 0; }
