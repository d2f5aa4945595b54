#include <stdio.h>
#include <stdlib.h>

#include "ops.h"

int main(int argc, char **argv)
{
    long result;
    if (argc != 4) {
        fprintf(stderr, "usage: %s A OP B\n", argv[0]);
        return 64;
    }
    switch (apply(argv[2][0], atol(argv[1]), atol(argv[3]), &result)) {
    case 0:
        printf("%ld\n", result);
        return 0;
    case 2:
        fprintf(stderr, "error: division by zero\n");
        return 1;
    default:
        fprintf(stderr, "error: unknown operator %s\n", argv[2]);
        return 1;
    }
}
