#include "ops.h"

/* Returns 0 on success, 1 for an unknown operator, 2 for a division by zero. */
int apply(char op, long a, long b, long *out)
{
    switch (op) {
    case '+':
        *out = a + b;
        return 0;
    case '-':
        *out = b - a;
        return 0;
    case 'x':
        *out = a * b;
        return 0;
    case '/':
        *out = a / b;
        return 0;
    case '%':
        *out = a % b;
        return 0;
    default:
        return 1;
    }
}
